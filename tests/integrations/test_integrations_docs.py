"""The examples of docs/integrations.md run as written: TRL's trainer, the Hugging Face ones and verl's
single-process call on CPU, verl's call with a group on 2 gloo ranks; the TRL option table is the integration's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
_EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```", re.S)


def _examples() -> dict[str, str]:
    return dict(_EXAMPLE.findall(DOC.read_text()))


def _run(name: str, **namespace) -> None:
    exec(compile(_examples()[name], f"{DOC.name}:{name}", "exec"), dict(namespace))


def test_every_section_has_an_example():
    assert set(_examples()) == {"trl", "hf-logprobs", "hf-gemma", "hf-grpo", "hf-gspo", "verl", "verl-tp",
                                 "hf-support-vllm", "hf-support-sglang"}


def test_trl_example(tmp_path):
    pytest.importorskip("trl")
    _run("trl", tmp_path=tmp_path)


def test_trl_option_table_is_the_integrations():
    pytest.importorskip("trl")
    from tplogp.integrations.trl import option_table

    found = re.search(r"<!-- trl-options: [^\n]*-->\n(.*?)<!-- /trl-options -->", DOC.read_text(), re.S)
    assert found and found.group(1) == option_table(), "docs/integrations.md: paste option_table()'s output"


@pytest.mark.parametrize("name", ["hf-logprobs", "hf-gemma", "hf-grpo", "hf-gspo",
                                  "hf-support-vllm", "hf-support-sglang"])
def test_hugging_face_examples(name):
    pytest.importorskip("transformers")
    _run(name)


def test_verl_example():
    _run("verl")


@pytest.mark.tp(world_size=2, timeout=120)
def test_verl_group_example(tp):
    _run("verl-tp", tp_group=tp.group)


def test_the_benchmark_table_has_its_marked_place():
    text = DOC.read_text()
    assert "<!-- integrations-benchmark:" in text and "<!-- /integrations-benchmark -->" in text
