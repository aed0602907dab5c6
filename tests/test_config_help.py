"""--help names --print_config, and what it says holds."""

import pytest
import yaml

from framework.config.cli import parse_config


def test_help_names_print_config_and_print_config_does_what_help_says(capsys, tmp_path):
    """Kills: --help without the --print_config line (LightningCLI users look for it there)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv=["--help"], program="train.py")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--print_config prints the resolved config as YAML (loadable with --config) and exits" in text

    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv=["--trainer.epochs", "3", "--print_config"], program="train.py")
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["trainer"]["epochs"] == 3
    (tmp_path / "config.yaml").write_text(printed)
    assert parse_config(argv=["--config", str(tmp_path / "config.yaml")]).trainer.epochs == 3  # loadable with --config
