"""Running untrusted code under caps (bubblewrap, memory, disk, processes, GPUs), and talking to it."""
