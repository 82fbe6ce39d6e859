"""Rank 0 sends SIGINT to the launcher the moment it starts, while the launcher may still be
starting rank 1; then every rank sleeps (the launcher must stop them all)."""

import os
import signal
import time

if os.environ.get("DTENSOR_CLIENT_ID") == "0":
    os.kill(os.getppid(), signal.SIGINT)
time.sleep(120)
