"""Print a digest of the final weights of every method after a few steps, and check that every
rank holds the same weights. The test runs this twice and compares the digests: the same
command with the same seeds must give bitwise-identical weights."""
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/scripts")  # report.weights_digest
from harness import Checks  # noqa: E402
from train_resumable import METHODS, build, train_step  # noqa: E402

import hvcomm.torch as hvd  # noqa: E402
import report  # noqa: E402

STEPS = 8


def main():
    hvd.init()
    checks = Checks()
    digests = {}

    def train(method):
        model, opt = build(method)
        for s in range(STEPS):
            train_step(model, opt, s)
        opt.finish_pending()
        digests[method] = report.weights_digest(model.named_parameters())
        everywhere = hvd.allgather_object(digests[method])
        assert len(set(everywhere)) == 1, f"{method}: ranks hold different weights"

    for method in METHODS:
        checks.run(method, train, method)
    if hvd.rank() == 0:
        print(json.dumps(digests), flush=True)
    checks.finish()


if __name__ == "__main__":
    main()
