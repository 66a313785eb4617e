"""``python -m hvcomm.advise``: the advisor (:mod:`hvcomm.sim.advise`) under its short name."""
import sys

from hvcomm.sim.advise import main

if __name__ == "__main__":
    sys.exit(main())
