"""Every row of docs/from-lightning.md's rename table is tested: each Lightning name the table lists
maps here to the tests that run the renamed counterpart, and each of those tests exists.

Fault caught: a row added to the table with no test behind it (mutant: a row's entry removed from
RENAME_TESTS -> named here), or a test renamed or deleted under a row (mutant: a name misspelt ->
named here)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RENAME_TESTS = {
    "`training_step(batch, batch_idx)`": ["test_lightning_port.py::test_the_lightning_program_matches_the_reference_on_sp"],
    "`validation_step` / `test_step` / `predict_step`": [
        "test_prediction.py::test_validate_and_test_load_last_best_or_a_path",
        "test_prediction.py::test_predict_gives_every_sample_once_in_dataset_order",
    ],
    "a `validation_step` that only calls `self.log(...)` and returns nothing": [
        "test_lightning_vocabulary.py::test_a_val_step_returning_none_records_what_it_logged_and_ranks_by_it",
        "test_lightning_cli_port.py::test_a_lightning_cli_program_ports_with_the_renames_and_equals_the_program_in_code",
    ],
    "`configure_optimizers()`": ["test_lightning_port.py::test_the_lightning_program_matches_the_reference_on_sp"],
    "`train_dataloader()`": ["test_lightning_port.py::test_the_lightning_program_matches_the_reference_on_two_ddp_ranks"],
    "`LightningDataModule`, `trainer.fit(model, datamodule=dm)`": [
        "test_data_module.py::test_a_data_module_trains_as_the_modules_own_loaders_do",
        "test_data_module.py::test_the_configs_data_section_naming_a_data_module_goes_to_the_trainer",
    ],
    "`self.log(name, value, prog_bar=, on_step=, on_epoch=, sync_dist=, batch_size=)`": [
        "test_lightning_port.py::test_the_lightning_program_matches_the_reference_on_two_ddp_ranks",
        "test_evaluation.py::test_epoch_means_are_weighted_by_batch_size_on_one_process",
    ],
    "`ModelCheckpoint(monitor, mode, save_top_k=K)`": [
        "test_lightning_port.py::test_save_top_k_semantics_need_a_best_count",
        "test_lightning_cli_port.py::test_a_lightning_cli_program_ports_with_the_renames_and_equals_the_program_in_code",
    ],
    "`EarlyStopping`, `LearningRateMonitor`, `StochasticWeightAveraging`, `ModelSummary`, `Timer`": [
        "test_callbacks.py::test_early_stopping_ends_training_after_patience_epochs_but_not_before_min_epochs",
        "test_callbacks.py::test_learning_rate_monitor_takes_lightnings_logging_interval",
        "test_weight_averaging.py::test_swa_averages_epochs_from_the_start_epoch_and_recomputes_batch_norm",
        "test_callbacks.py::test_model_summary_logs_parameter_counts_when_training_starts",
        "test_callbacks.py::test_timer_records_epoch_and_total_time",
    ],
    "`Trainer(max_epochs=, accelerator=, strategy=, precision=)`": [
        "test_config_classes.py::test_lightning_sections_are_honoured_in_a_run"
    ],
    "`lightning_logs/version_N`": [
        "test_checkpoint_safety.py::test_a_rerun_by_default_trains_in_a_new_version_directory_and_says_so_once"
    ],
    '`configure_optimizers()` returning `{"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": ..., "monitor": ...}}`'
    " (or a list of such dicts)": [
        "test_lightning_vocabulary.py::test_lightnings_outer_optimizer_dict_is_honoured_with_its_scheduler"
    ],
    "`self.log(..., logger=False)`": [
        "test_lightning_vocabulary.py::test_log_with_logger_false_stays_out_of_the_loggers_but_reaches_the_history"
    ],
    '`self.log("train_loss", ...)`': [
        "test_metrics.py::test_a_user_log_of_a_framework_name_replaces_its_series_with_a_warning_naming_the_clash"
    ],
    "`num_sanity_val_steps=2` (Lightning's default)": [
        "test_sanity_check.py::test_it_is_on_by_default_as_in_lightning",
        "test_sanity_hook_pairing.py::test_plain",
    ],
    "`self.save_hyperparameters()`, `self.hparams.lr`, `hparams.yaml`": [
        "test_hyperparameters.py::test_hparams_from_init_into_config_yaml_and_checkpoints_and_back"
    ],
    "`configure_model()` (meta-device models under FSDP), `init_module(empty_init=True)`": [
        "test_fsdp_layouts.py::test_a_model_built_on_the_meta_device_starts_in_a_shard_of_its_memory_and_trains_as_built_normally",
        "test_activation_checkpointing.py::test_configure_model_units_are_checkpointed_on_every_backend",
    ],
    "`ModelParallelStrategy` + `configure_model()` calling `parallelize_module` / `fully_shard`": [
        "test_model_parallel.py::test_2x2_and_1x2_match_sp_per_step_and_in_final_weights",
        "test_loss_parallel_habit.py::test_a_train_steps_own_loss_parallel_works_with_the_switch_and_is_named_without_it",
    ],
    "`transformers` `Trainer`": ["test_transformers.py::test_a_port_by_the_guide_trains_the_hf_trainers_run_clipping_included"],
    "`LightningCLI`, `class_path` / `init_args`, `--print_config`": [
        "test_config_classes.py::test_lightning_sections_are_honoured_in_a_run",
        "test_config.py::test_print_config_prints_the_resolved_yaml_and_exits",
    ],
}


def table_rows() -> list:
    """The first cells of the rename table (the one headed ``| Lightning | here |``)."""
    with open(os.path.join(ROOT, "docs", "from-lightning.md")) as handle:
        lines = handle.read().splitlines()
    start = lines.index("| Lightning | here |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append(line[2:].split(" | ")[0])
    return rows


def functions_in(file: str) -> set:
    with open(os.path.join(ROOT, "tests", file)) as handle:
        tree = ast.parse(handle.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


def test_every_row_of_the_rename_table_names_tests_that_exist():
    rows = table_rows()
    assert len(rows) >= 20, rows
    untested = [row for row in rows if row not in RENAME_TESTS]
    assert not untested, f"rows of docs/from-lightning.md's table with no test in RENAME_TESTS: {untested}"
    assert not set(RENAME_TESTS) - set(rows), f"entries for rows the table no longer has: {set(RENAME_TESTS) - set(rows)}"
    missing = []
    for row, tests in RENAME_TESTS.items():
        for name in tests:
            file, _, function = name.partition("::")
            if function not in functions_in(file):
                missing.append(f"{row}: {name}")
    assert not missing, "tests named under a row that do not exist:\n" + "\n".join(missing)
