"""Writes multi-line log messages the ways TF and Python do (for the launcher's prefix test)."""

import logging
import os
import sys

os.write(2, b"E0000 00:00 a C++ log message\n  its second line\n  its third line\n")  # one write, like absl
logging.warning("a Python warning\nwith a continuation line")
sys.stdout.write("epoch 1/2\rstep 2/2\n")  # a progress bar redraw
sys.stdout.write("no trailing newline")
sys.stdout.flush()
