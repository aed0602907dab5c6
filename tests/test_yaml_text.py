"""config.yaml's writer: whatever plain values it is given, PyYAML reads back the same values."""

import math
import random
import sys
from typing import Any

import pytest
import yaml

from framework.config.arguments import TrainerArguments
from framework.config.cli import parse_config, resolved_config
from framework.config.yaml_text import to_yaml

# Strings that read back as something else when written plain, or that need escapes.
TRICKY_STRINGS = [
    "",
    " ",
    "yes",
    "No",
    "ON",
    "off",
    "y",
    "n",
    "true",
    "False",
    "null",
    "Null",
    "~",
    "-",
    "--",
    "---",
    "...",
    "1",
    "-1",
    "0x1f",
    "0o17",
    "1_000",
    "1e-5",
    "1.0e+16",
    ".inf",
    "-.Inf",
    ".nan",
    "1:20",
    "2026-11-26",
    "2026-11-26 01:02:03",
    "<<",
    "=",
    "a: b",
    "a #b",
    "#x",
    "key:",
    "[1, 2]",
    "{a: 1}",
    "*alias",
    "&anchor",
    "!tag",
    "%x",
    "@x",
    "`x",
    "|",
    ">",
    "'single'",
    '"double"',
    "back\\slash",
    "tab\there",
    "line\nbreak",
    "cr\rreturn",
    "nul\0byte",
    "\x07bell",
    "\x7fdel",
    "\x85nel",
    "\u2028ls",
    "\u2029ps",
    "\ufeffbom",
    "caf\u00e9",
    "\u65e5\u672c",
    "emoji \U0001f600",
    " leading",
    "trailing ",
    "cuda:0",
    "s3://bucket/key",
    "/abs/path",
    "rel/path.pt",
    "ddp-amp",
    "_private",
    "x" * 300,
]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -7, 2**40, -(2**63), 10**30])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1.5, 1e-5, 3e-300, 1e16, 1.7976931348623157e308, -2.5e-7, math.inf, -math.inf])
    if kind in (4, 5):
        return rng.choice(TRICKY_STRINGS)
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(TRICKY_STRINGS) + str(index): random_value(rng, depth + 1) for index in range(rng.randrange(4))}


@pytest.mark.parametrize("seed", range(40))
def test_generated_values_read_back_equal(seed: int) -> None:
    rng = random.Random(seed)
    data = {rng.choice(TRICKY_STRINGS) + str(index): random_value(rng) for index in range(8)}
    assert yaml.safe_load(to_yaml(data)) == data


def test_every_tricky_string_as_key_and_value() -> None:
    data = {text: text for text in TRICKY_STRINGS}
    data["list"] = list(TRICKY_STRINGS)
    text = to_yaml(data)
    assert yaml.safe_load(text) == data
    assert text.isascii()  # readable whatever the reader's locale, as PyYAML's own files


def test_floats_keep_their_bits() -> None:
    rng = random.Random(0)
    values = [rng.uniform(-1, 1) * 10 ** rng.randrange(-320, 308) for _ in range(500)] + [sys.float_info.min, 5e-324]
    read = yaml.safe_load(to_yaml({"values": values, "nan": math.nan}))
    assert read["values"] == values and all(isinstance(value, float) for value in read["values"])
    assert math.isnan(read["nan"])


def test_the_resolved_config_reads_back_as_pyyaml_wrote_it() -> None:
    config = parse_config(argv=["--trainer.epochs", "3", "--trainer.output_dir", "out: yes/#1", "--backend", "ddp-amp"])
    data = config.to_dict()
    assert yaml.safe_load(to_yaml(data)) == yaml.safe_load(yaml.safe_dump(data)) == data
    assert "  epochs: 3\n" in to_yaml(data) and "  backend: ddp-amp\n" in to_yaml(data)  # still reads like YAML
    assert resolved_config(TrainerArguments()).to_dict() == yaml.safe_load(to_yaml(resolved_config(TrainerArguments()).to_dict()))


def test_a_value_it_cannot_write_is_named() -> None:
    with pytest.raises(TypeError, match=r"trainer\.sizes\.1 = b'x' is a bytes: allowed are None, bool"):
        to_yaml({"trainer": {"sizes": [1, b"x"]}})
    with pytest.raises(TypeError, match=r"config key trainer\.3 must be a string"):
        to_yaml({"trainer": {3: "x"}})
