"""``moezero example tiny-hf DIR`` (``moezero.examples.tiny_hf``): the README's fine-tune starts
from it, so it must make a Hugging Face folder ``import-hf`` and ``prepare-data`` take, offline,
the same every time, and never write over what is there (the wheel smoke runs the rest)."""

from __future__ import annotations

import json

import pytest

from moezero.cli import main


def test_tiny_hf_makes_a_model_folder_and_chats(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert main(["example", "tiny-hf", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {tmp_path / 'tiny-qwen3'} (a random Qwen3-MoE: 2 layers, "
                           "4 experts, "), line
    folder = tmp_path / "tiny-qwen3"
    assert {p.name for p in folder.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja"}
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_moe"
    chats = [json.loads(x) for x in (tmp_path / "chats.jsonl").read_text().splitlines()]
    assert len(chats) == 200 and chats[0]["messages"][-1]["role"] == "assistant"
    before = (tmp_path / "chats.jsonl").read_bytes()
    assert main(["example", "tiny-hf", str(tmp_path)]) == 2  # never over what is there
    err = capsys.readouterr().err.strip()
    assert err == (f"moezero: error: example tiny-hf: {folder}: exists (the example writes a "
                   "new one)"), err
    assert (tmp_path / "chats.jsonl").read_bytes() == before
