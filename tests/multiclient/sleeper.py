"""Sleeps until a signal arrives; reports which one (for the launcher's forwarding test)."""

import signal
import sys
import time


def stop(signum, frame):
    print(f"got signal {signum}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(120)
