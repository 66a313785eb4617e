"""What tests/mpi/elastic_train.py's ranks log (OUT/steps.rank<R>.jsonl), read for the tests."""
import json


def logged_ranks(directory):
    """The world ranks that left a log in ``directory``."""
    return sorted(int(f.name[len("steps.rank"):-len(".jsonl")])
                  for f in directory.glob("steps.rank*.jsonl"))


def logged(directory, rank):
    """World rank ``rank``'s log: one dict per line."""
    return [json.loads(line) for line in (directory / f"steps.rank{rank}.jsonl").read_text()
            .splitlines()]


def newest_saved_by_all(directory, ranks, key="saved"):
    """The newest commit (its step, or with key="commit" its number) that each of ``ranks``
    had saved before its first restore, by their own logs: the commit they must restore."""
    newest = []
    for rank in ranks:
        rows = logged(directory, rank)
        first_restore = next((i for i, row in enumerate(rows) if "restored" in row), len(rows))
        newest.append(max((row[key] for row in rows[:first_restore] if key in row), default=0))
    return min(newest)
