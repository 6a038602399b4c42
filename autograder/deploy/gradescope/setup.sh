#!/usr/bin/env bash
# Gradescope builds the autograder image with this (Ubuntu, as root): Python, CPU torch, the course kit.
set -euo pipefail
apt-get install -y python3 python3-pip bubblewrap
cd /autograder/source
python3 -m pip install --break-system-packages torch torchvision --index-url https://download.pytorch.org/whl/cpu \
  || python3 -m pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install --break-system-packages -e . || python3 -m pip install -e .
