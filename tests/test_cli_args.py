"""Issue 25, must-work 5: the command line takes what users type. KEY=VALUE settings go anywhere
among a command's options (before, between, after), an option's value keeps any '=' it has, and
anything else is one error line naming it; a task named only in the --config file brings its keys
and its commands to --help. Parsing only: no torchrun, no training."""

from __future__ import annotations

from pathlib import Path

import pytest

from distqa.cli import build_parser, main

# (command line, the settings it holds in order, an option's value to check)
INTERMIXED = [
    (
        [
            "predict",
            "task.max_seq_len=64",
            "--input",
            "F",
            "--checkpoint",
            "C",
            "--output",
            "a=b",
            "task.doc_stride=32",
        ],
        ["task.max_seq_len=64", "task.doc_stride=32"],
        ("output", "a=b"),
    ),
    (
        ["train", "train.lr=1e-4", "--check-config", "train.max_steps=3", "--config", "x.yaml", "train.max_steps=7"],
        ["train.lr=1e-4", "train.max_steps=3", "train.max_steps=7"],
        ("config", "x.yaml"),
    ),
    (
        ["bench", "model.name=tiny", "--nproc", "1,2", "train.batch_size=4", "--output", "o", "--steps", "3", "seed=1"],
        ["model.name=tiny", "train.batch_size=4", "seed=1"],
        ("nproc", "1,2"),
    ),
    (
        ["prepare", "--input=i.jsonl", "task.max_seq_len=128", "--output", "o", "model.tokenizer=x", "--num-proc", "2"],
        ["task.max_seq_len=128", "model.tokenizer=x"],
        ("num_proc", 2),
    ),
]


@pytest.mark.parametrize(("argv", "settings", "option"), INTERMIXED, ids=lambda v: v[0] if isinstance(v, list) else "")
def test_settings_go_anywhere_among_a_commands_options(argv, settings, option):
    args = build_parser().parse_args(argv)
    assert args.overrides == settings  # in command-line order: the later of two values wins
    assert getattr(args, option[0]) == option[1]


def test_train_check_config_takes_settings_before_between_and_after_its_options(capsys):
    argv = ["train", "train.max_steps=3", "--check-config", "train.lr=1e-4", "--config", "configs/quickstart.yaml"]
    assert main([*argv, "model.dropout=0.0"]) == 0, capsys.readouterr().err
    # The settings are read, not dropped: a bad one after the options fails as it would before them.
    assert main([*argv, "train.max_stepz=3"]) == 2
    assert "unknown config key 'train.max_stepz'" in capsys.readouterr().err


def test_predict_reads_the_settings_on_both_sides_of_its_options(tmp_path, capsys):
    """The issue's command line gets past its arguments to the settings (ending at a misspelled one
    after the options, before any file is read or torch imported, so that the test stays quick)."""
    argv = ["predict", "task.max_seq_len=64", "--input", str(tmp_path / "test.jsonl"), "--checkpoint", str(tmp_path)]
    assert main([*argv, "--output", str(tmp_path / "s.csv"), "task.doc_strid=32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "distqa: error: unknown config key 'task.doc_strid' in the command line (did you mean task.doc_stride?)"
    )


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


PREDICT = ["predict", "--input", "F", "--checkpoint", "C"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # A misspelled required option: the misspelling, not "required: --output".
        ([*PREDICT, "--outptu", "S"], "distqa predict: error: unrecognized option '--outptu' (did you mean --output?)"),
        (
            ["train", "--chek-config"],
            "distqa train: error: unrecognized option '--chek-config' (did you mean --check-config?)",
        ),
        (
            ["train", "x=1", "--confg=a.yaml"],
            "distqa train: error: unrecognized option '--confg' (did you mean --config?)",
        ),
        (
            [*PREDICT, "--output", "S", "test.jsonl", "task.doc_stride=32"],
            "distqa predict: error: unrecognized argument 'test.jsonl': neither an option nor a KEY=VALUE setting",
        ),
        (
            ["download", "--output", "d", "model.name=tiny"],
            "distqa download: error: unrecognized argument 'model.name=tiny': "
            "distqa download takes no KEY=VALUE settings",
        ),
    ],
    ids=["misspelled-required", "misspelled-flag", "misspelled-with-value", "bare-word", "no-settings"],
)
def test_what_is_neither_an_option_nor_a_setting_is_one_line_naming_it(argv, says, capsys):
    assert _usage_error(argv, capsys) == says


FORK = "toy_task:CommandTask"  # tests/toy_task.py: a task with a key (task.size) and a command (toy-count)


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_a_task_named_in_the_config_file_brings_its_keys_and_commands(tmp_path: Path, capsys):
    fork = tmp_path / "fork.yaml"
    fork.write_text(f"task:\n  name: {FORK}\n  size: 77\n")
    text = _help(["train", "--config", str(fork)], capsys)
    assert f"task.name={FORK!r}:" in text and "  task.size = 4096" in text
    assert "task.size" in _help(["train", f"--config={fork}"], capsys)
    (tmp_path / "short.yaml").write_text(f"task: {FORK}\n")  # the shorthand `task: NAME`
    assert "task.size" in _help(["train", "--config", str(tmp_path / "short.yaml")], capsys)
    # The command line wins over the file, for --help as for the run.
    text = _help(["train", "--config", str(fork), "task=textcls"], capsys)
    assert "task.name='textcls':" in text and "task.size" not in text
    # The task's own command exists with the file alone, and reads it.
    assert "--config FILE" in _help(["toy-count", "--config", str(fork)], capsys)
    assert main(["toy-count", "--config", str(fork)]) == 0
    assert capsys.readouterr().out.strip() == "77 examples"


def test_a_config_file_help_cannot_read_leaves_help_working_with_a_note(tmp_path: Path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    for path in (bad, tmp_path / "missing.yaml"):
        text = _help(["train", "--config", str(path)], capsys)
        assert "task.name='nq':" in text and "train.lr = 3e-05" in text  # the default task's keys
        assert text.strip().splitlines()[-1].startswith(f"(note: --config {path} was not read (")
    # A command of the task the file would have named: the error says why it is unknown.
    said = _usage_error(["toy-count", "--config", str(bad)], capsys)
    assert "invalid choice: 'toy-count'" in said and f"; note: --config {bad} was not read (" in said


def test_new_task_is_a_built_in_command(capsys):
    text = " ".join(_help([], capsys).split())
    assert "new-task write a new task" in text
    assert "--dir DIR" in _help(["new-task"], capsys)


def test_an_unknown_command_gets_its_likely_spelling_or_where_a_tasks_commands_come_from(capsys):
    assert _usage_error(["trian"], capsys).strip().endswith("; did you mean train?")
    said = _usage_error(["toy-count"], capsys)  # a fork's command, its task not named
    assert "invalid choice: 'toy-count'" in said and said.strip().endswith(
        "; a task's own commands appear when it is named: add task.name=module:Class or --config FILE"
    )
