"""The lm-eval task YAMLs ddiloco writes and reads (no lm-eval needed): what they say, and that reading a
user's task directory is safe YAML with only lm-eval's `!function` tag added."""

import pytest
import yaml

from ddiloco.data.tokenizer import ByteTokenizer
from ddiloco.posttrain.lmeval import _defined_tasks, _read_yaml, write_task_dir
from ddiloco.posttrain.tasks import TaskItem


def test_task_yamls_give_the_eos_text_plus_prompt_and_no_delimiter(tmp_path):
    tasks = {"mc": [TaskItem("mc", "pick", " a", (" a", " b"))], "em": [TaskItem("em", "say", " hi")]}
    names = write_task_dir(tasks, ByteTokenizer(), tmp_path)
    assert names == ["ddiloco_em", "ddiloco_mc"] and (tmp_path / "utils.py").is_file()
    mc = _read_yaml((tmp_path / "mc.yaml").read_text())
    assert mc["output_type"] == "multiple_choice" and mc["target_delimiter"] == ""
    em = _read_yaml((tmp_path / "em.yaml").read_text())
    assert em["process_results"] == "utils.process_results" and em["generation_kwargs"]["until"] == ["<eos>"]
    assert (tmp_path / "mc.jsonl").read_text().startswith('{"context": "<eos>pick"')
    assert _defined_tasks(tmp_path) == ["ddiloco_em", "ddiloco_mc"]
    with pytest.raises(ValueError, match="instruction items"):
        write_task_dir({"i": [TaskItem("i", "q", " a", chat=True)]}, ByteTokenizer(), tmp_path / "chat")


def test_reading_a_task_yaml_refuses_python_objects(tmp_path):
    with pytest.raises(yaml.YAMLError):
        _read_yaml("task: x\nboom: !!python/object/apply:os.system ['true']\n")
    (tmp_path / "bad.yaml").write_text("task: [unclosed\n")
    with pytest.raises(ValueError, match="not a readable task YAML"):
        _defined_tasks(tmp_path)
    (tmp_path / "bad.yaml").write_text("group: only_a_group\n")
    with pytest.raises(ValueError, match="defines no lm-eval task"):
        _defined_tasks(tmp_path)
