"""A reader process for the pinned-version tests: pins a key and answers line commands on stdin.

Run as ``python tests/version_worker.py PATH SETTINGS_JSON KEY``. Commands, one per line,
each answered by one line on stdout:

    pin        pin KEY                   -> ``PINNED <pin version> <value version>``
    load       load through the pin      -> ``PINNED-VALUE <value version>``
    release    release the pin           -> ``RELEASED``
    exit       close the memory and exit -> ``BYE``
"""

from __future__ import annotations

import json
import sys

import kvmem
from kvmem.errors import KVMemError
from tests.workers import check_value


def main(path: str, settings: str, key: str) -> None:
    memory = kvmem.Memory(path, **json.loads(settings))
    pin = None
    for line in sys.stdin:
        cmd = line.strip()
        try:
            if cmd == "pin":
                pin = memory.pin(key)
                assert pin is not None, f"{key} is not stored"
                print("PINNED", pin.version, check_value(key, pin.load()))
            elif cmd == "load":
                assert pin is not None
                print("PINNED-VALUE", check_value(key, pin.load()))
            elif cmd == "release":
                assert pin is not None
                pin.release()
                print("RELEASED")
            elif cmd == "exit":
                memory.close()
                print("BYE", flush=True)
                return
            else:
                print("UNKNOWN", cmd)
        except KVMemError as exc:
            print("ERROR", type(exc).__name__, exc)
        sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
