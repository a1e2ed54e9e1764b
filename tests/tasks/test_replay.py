"""Failure replay: records re-created and re-scored identically, library and CLI."""

import json

import pytest

from posttrain.tasks import registry, train_seed
from posttrain.tasks.replay import (
    format_trace,
    make_record,
    read_records,
    replay,
    write_records,
)

from ._subprocess import run_python


def _records():
    out = []
    for i, name in enumerate(["arithmetic/mul_d2", "strings/rotate_l3", "lists/unique_l2"]):
        domain = registry.get(name)
        task = domain.sample(train_seed(i))
        for completion in [domain.demonstration(task), "<answer>nope</answer>", "rambling"]:
            out.append(
                make_record(task, completion, domain.score(task, completion), include_task=True)
            )
    return out


def test_records_replay_identically(tmp_path):
    path = tmp_path / "failures.jsonl"
    records = _records()
    write_records(path, records)
    loaded = read_records(str(path))
    assert loaded == json.loads(json.dumps(records))
    for record in loaded:
        result = replay(record)
        assert result.identical and result.task_matches
        assert result.reward.to_dict() == record["reward"]
        trace = format_trace(result)
        assert result.task.prompt.splitlines()[0] in trace and "identical:  yes" in trace


def test_tampered_record_is_reported():
    record = _records()[0]
    record["reward"]["value"] = 0.0
    assert not replay(record).identical
    record = _records()[0]
    record["task"]["answer"] = "something else"
    result = replay(record)
    assert result.task_matches is False and not result.identical


def test_inline_json_and_errors(tmp_path):
    inline = json.dumps(
        {"domain": "arithmetic/add_d1", "seed": 4, "completion": "<answer>3</answer>"}
    )
    assert read_records(inline)[0]["seed"] == 4
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="lacks"):
        read_records('{"domain": "arithmetic/add_d1"}')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"domain": "a/b", "seed": 1, "completion": ""}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_records(str(bad))


def _cli(*args):
    return run_python("-m", "launch.replay", *args)


def test_cli_prints_the_same_trace(tmp_path):
    path = tmp_path / "failures.jsonl"
    records = _records()
    write_records(path, records)
    proc = _cli(str(path), "--index", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == format_trace(replay(records[4])).strip()
    again = _cli(str(path), "--index", "4")
    assert again.stdout == proc.stdout
    everything = _cli(str(path))
    assert everything.returncode == 0 and everything.stdout.count("identical:  yes") == len(records)


def test_cli_exit_code_flags_mismatch_and_bad_index(tmp_path):
    record = _records()[0]
    record["reward"]["value"] = 0.5
    proc = _cli(json.dumps(record))
    assert proc.returncode == 1 and "identical:  NO" in proc.stdout
    path = tmp_path / "one.jsonl"
    write_records(path, [_records()[0]])
    bad = _cli(str(path), "--index", "7")
    assert bad.returncode != 0 and "out of range" in bad.stderr


@pytest.mark.parametrize("arg, message", [
    ("/no/such/records.jsonl", "error: record file not found: '/no/such/records.jsonl'"),
    ('{"domain": "nope/x", "seed": 1, "completion": "a"}', "error: unknown domain 'nope/x'"),
    ('{"domain": "arithmetic/add_d1", "seed": "x", "completion": "a"}',
     "error: record seed must be an integer, got 'x'"),
    ('{"domain": "arithmetic/add_d1", "completion": "a"}', "error: record 0 lacks ['seed']"),
])
def test_cli_bad_records_are_one_line_errors(arg, message):
    proc = _cli(arg)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
