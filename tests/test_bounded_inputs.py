"""Bounded inputs and messages: YAML alias bombs and deep nesting refused within time and memory
(framework/config/bounded_yaml.py), every value in a message bounded (framework/config/bounded_repr.py)."""

import json
import subprocess
import sys
import textwrap

import pytest

from framework import parse_config
from framework.config.bounded_repr import bounded_repr
from framework.config.bounded_yaml import YamlRefused, load_yaml
from framework.config.cli import ConfigError


def alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes that stand for 9**levels strings."""
    lines, previous = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'], "a0"
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ",".join([f"*{previous}"] * 9) + "]")
        previous = f"a{level}"
    return "\n".join(lines) + "\n"


MEASURE = textwrap.dedent(
    """
    import dataclasses, json, resource, sys, time
    from typing import Any
    start = time.monotonic()
    from framework import parse_config
    from framework.run.finished_run import changed_settings
    from framework.run.run_identity import recorded_run_id
    imported_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    @dataclasses.dataclass
    class Model:
        extra: Any = None  # anything goes: only the bound stops a bomb here

    try:
        config = parse_config({"model": Model}, argv=["--config", sys.argv[1]])
        config.save(sys.argv[2] + "/saved.yaml")  # writing it walks every value
        message = ""
    except Exception as error:
        message = str(error)
    recorded_run_id(sys.argv[2])  # what a resume reads from the run's config.yaml
    changes = changed_settings(sys.argv[2] + "/config.yaml", {"trainer": {"epochs": 1}})
    print(json.dumps({"message": len(message), "changes": len(repr(changes)), "text": message[:300],
                      "seconds": time.monotonic() - start,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "imported_mb": imported_mb}))
    """
)


def flat_mapping(size: int = 2_000_000) -> str:
    """An alias-free mapping of about ``size`` characters (150 000 keys in 2 MB)."""
    lines, total, index = [], 0, 0
    while total < size:
        lines.append(f"k{index}: {index}\n")
        total += len(lines[-1])
        index += 1
    return "".join(lines)


@pytest.mark.parametrize("where", ["value", "any", "flat"])
def test_alias_bomb_refused_fast_small_and_with_a_short_message(tmp_path, where):
    """Kills: yaml.safe_load without the expanded-size count ("any": a field typed Any takes the bomb and
    saving it walks 387 million strings); {value!r} in messages ("value": a 279 MB message). "flat": a 2 MB
    alias-free mapping, refused by the event count before any node is composed (mutant: the event pass
    removed -> composed whole, 194 s and 980 MB under load, and called an alias bomb)."""
    bomb = alias_bomb() if where != "flat" else flat_mapping()
    text = ("trainer:\n  epochs:\n" if where == "value" else "model:\n  extra:\n") + textwrap.indent(bomb, "    ")
    config = tmp_path / "bomb.yaml"
    config.write_text(text)
    assert len(text) < 1000 or where == "flat"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run_id: abc\n" + text)
    done = subprocess.run([sys.executable, "-c", MEASURE, str(config), str(run_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    expected = "holds more than 100000 values" if where == "flat" else "alias"
    assert expected in figures["text"] and "bomb.yaml" in figures["text"], figures
    assert figures["message"] < 100_000 and figures["changes"] < 100_000
    assert figures["seconds"] < 30, figures  # the import included, on a loaded machine; unbounded: 15-194 s
    # The bound is 300 MB for the process; torch's import alone takes ~230 MB of it, so what the
    # bomb may add is held tighter (the unbounded reader adds gigabytes).
    assert figures["rss_mb"] - figures["imported_mb"] < 64, figures


def test_deep_nesting_refused_with_a_message():
    with pytest.raises(YamlRefused, match="nested"):
        load_yaml("[" * 5000 + "]" * 5000)
    with pytest.raises(YamlRefused, match="nested"):
        load_yaml("a: &a [*a]")  # a list that holds itself


def test_a_big_value_under_the_bound_gives_a_bounded_message(tmp_path):
    """Kills: {value!r} in the config error (the message holds all 59049 strings)."""
    config = tmp_path / "big.yaml"
    config.write_text("trainer:\n  epochs:\n" + textwrap.indent(alias_bomb(5), "    "))
    with pytest.raises(ConfigError) as raised:
        parse_config(argv=["--config", str(config)])
    message = str(raised.value)
    assert len(message) < 1000 and "trainer.epochs=a dict of 5 keys" in message, message


def test_bounded_repr_shows_type_and_size():
    assert bounded_repr("x" * 10**6).startswith("a str of 1000000 characters")
    assert bounded_repr(list(range(10**6))).startswith("a list of 1000000 items")
    assert bounded_repr({"a": 1}) == "{'a': 1}"
    assert len(bounded_repr([[list(range(1000))] * 1000] * 1000)) < 300
    assert bounded_repr(3) == "3" and bounded_repr("three") == "'three'"


def test_a_plain_config_still_loads(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("trainer: {epochs: &n 2, log_every_n_steps: *n}\n")
    trainer = parse_config(argv=["--config", str(config)]).trainer
    assert (trainer.epochs, trainer.log_every_n_steps) == (2, 2)


def test_a_key_written_twice_is_refused_naming_the_key_and_both_lines(tmp_path):
    """Two ``trainer:`` sections: PyYAML keeps the second silently (mutant: the duplicate check removed ->
    epochs 5, the first section's seed dropped without a word)."""
    config = tmp_path / "twice.yaml"
    config.write_text("trainer:\n  seed: 7\nmodel: {}\ntrainer:\n  epochs: 5\n")
    with pytest.raises(ConfigError) as raised:
        parse_config(argv=["--config", str(config)])
    message = str(raised.value)
    assert "twice.yaml" in message and "'trainer' appears twice" in message and "lines 1 and 4" in message, message
    with pytest.raises(YamlRefused, match=r"'lr' appears twice in one mapping \(lines 2 and 3\)"):
        load_yaml("optimizer:\n  lr: 0.1\n  lr: 0.2\n")
    assert load_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  d: 2\n") == {"a": {"b": 1}, "c": {"b": 1, "d": 2}}  # merge keys


def test_an_integer_past_pythons_digit_limit_is_a_named_error_never_a_raw_crash(tmp_path):
    """A 5000-digit integer (Python reads at most 4300 digits from text) in ``--config`` and in a run's
    ``config.yaml`` read at resume (mutant: the int constructor's ValueError let through -> a raw ValueError
    from every resume)."""
    from framework.run.finished_run import changed_settings
    from framework.run.run_identity import UNREADABLE, recorded_run_id

    text = "trainer:\n  seed: " + "7" * 5000 + "\n"
    config = tmp_path / "huge.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as raised:
        parse_config(argv=["--config", str(config)])
    message = str(raised.value)
    assert "huge.yaml" in message and "line 2" in message and "5000 characters" in message and len(message) < 1000, message
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run_id: abc\n" + text)
    assert recorded_run_id(str(run_dir)) == UNREADABLE  # unknown, said by the YAML reader; never a raw ValueError
    changed_settings(str(run_dir / "config.yaml"), {"trainer": {"seed": 1}})
