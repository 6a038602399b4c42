from labkit.cli import console

console()
