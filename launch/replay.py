"""Re-create a recorded task, re-score its completion and print the trace.

    python -m launch.replay failures.jsonl --index 3
    python -m launch.replay '{"domain": "arithmetic/add_d1", "seed": 4, "completion": "<answer>9</answer>"}'

Exits 1 when a replayed reward differs from the recorded one.
"""

from absl import app, flags

from launch import common
from posttrain.tasks import registry
from posttrain.tasks.replay import format_trace, read_records, replay

_INDEX = flags.DEFINE_integer("index", None, "Replay only this record (0-based); default: all.")
_TASK_FILES = flags.DEFINE_multi_string(
    "task_file", [], "User JSONL task files to register before replaying (domain jsonl/<stem>)."
)


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("usage: python -m launch.replay RECORD_FILE_OR_JSON [--index i]")
    try:
        return _replay(argv[1])
    except KeyError as e:  # an unknown domain: the message, not "unknown config key"
        common.fail(ValueError(e.args[0] if e.args else str(e)))
    except (ValueError, OSError) as e:
        common.fail(e)


def _replay(source: str) -> int:
    if _TASK_FILES.value:
        from posttrain.tasks.jsonl import JsonlDomain  # grain is slow to import; only when needed

        for path in _TASK_FILES.value:
            registry.register(JsonlDomain.from_file(path), replace=True)
    records = read_records(source)
    if _INDEX.value is not None:
        if not 0 <= _INDEX.value < len(records):
            raise app.UsageError(f"--index {_INDEX.value} out of range: {len(records)} record(s)")
        records = [records[_INDEX.value]]
    all_identical = True
    for i, record in enumerate(records):
        result = replay(record)
        all_identical &= result.identical
        if i:
            print("-" * 60)
        print(format_trace(result))
    return 0 if all_identical else 1


if __name__ == "__main__":
    app.run(main)
