"""``prepare-data --format chat|prompt-completion`` (issue 26 item 1, docs/data.md): token ids equal
``AutoTokenizer.apply_chat_template`` on every family's template shape (chat_util), the loss mask
keeps the assistant's tokens (checked by decoding them, and against transformers' own
``{% generation %}`` mask), mask shards are checksummed and read through ``TokenDataset.mask``,
and bad records are one line naming file:line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from moezero.cli import main
from moezero.data.common import DataError
from moezero.data.indexed import TokenDataset
from tests.torch_impl.chat_util import (
    CHATML,
    MISTRAL,
    OLMOE,
    QWEN3,
    QWEN3_GENERATION,
    chat_tokenizer,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

SYSTEM = {"role": "system", "content": "Be brief."}


def turns(*texts: str) -> list[dict]:
    """Alternating user/assistant messages."""
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]


CONVERSATIONS = [
    [SYSTEM, *turns("the cat sat?", "the dog ran. ✓", "and then?", "a big red fox.")],
    turns("hello", "Hello, how are you?"),
    [*turns("2+2?", ""), {"role": "user", "content": "well?"},
     {"role": "assistant", "content": "2+2=4 ünïcødé"}],
    [*turns("weather?"), {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}],
]
# What each family's template writes after an assistant message's content (trained too).
FAMILIES = {
    "chatml": (CHATML, "", "<|im_end|>\n", CONVERSATIONS),
    "chatml-legacy": (CHATML, "", "<|im_end|>\n", CONVERSATIONS),
    "qwen3": (QWEN3_GENERATION, "", "<|im_end|>", CONVERSATIONS[:3]),
    "mistral": (MISTRAL, " ", "</s>", [c for c in CONVERSATIONS[1:3]]),
    "olmoe": (OLMOE, "", "</s>\n", CONVERSATIONS[:3]),
}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prepare(inputs, out, tok_dir, *extra) -> int:
    return main(["prepare-data", *map(str, inputs), "--tokenizer", str(tok_dir),
                 "--out", str(out), "--workers", "1", *extra])


def documents(ds: TokenDataset) -> list[tuple[list[int], list[bool]]]:
    return [(ds.read(int(a), int(b)).tolist(), ds.mask(int(a), int(b)).tolist())
            for a, b in zip(ds.offsets[:-1], ds.offsets[1:], strict=True)]


def assistant_texts(conv: list[dict], prefix: str, suffix: str) -> str:
    """The text the mask must keep, written out from the conversation itself (tool calls as
    the ChatML template writes them)."""
    def calls(m):
        return "".join("\n<tool_call>\n" + json.dumps(c["function"], ensure_ascii=False) +
                       "\n</tool_call>" for c in m.get("tool_calls", []))

    return "".join(prefix + (m["content"] or "") + calls(m) + suffix for m in conv
                   if m["role"] == "assistant")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_ids_equal_apply_chat_template_and_mask_keeps_assistant_text(tmp_path, family):
    template, prefix, suffix, convs = FAMILIES[family]
    if family != "chatml":
        convs = [c for c in convs if not any(m.get("tool_calls") for m in c)]
    tok_dir = chat_tokenizer(tmp_path / "tok", template, legacy=family.endswith("legacy"))
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in convs])
    assert prepare([data], tmp_path / "out", tok_dir, "--format", "chat") == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    docs = documents(TokenDataset(tmp_path / "out"))
    assert len(docs) == len(convs)
    for conv, (ids, mask) in zip(convs, docs, strict=True):
        assert ids == hf.apply_chat_template(conv, tokenize=True)["input_ids"]
        kept = hf.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert kept == assistant_texts(conv, prefix, suffix)


def test_generation_markers_give_transformers_assistant_mask(tmp_path):
    tok_dir = chat_tokenizer(tmp_path / "tok", QWEN3_GENERATION)
    conv = CONVERSATIONS[0]
    write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}])
    assert prepare([tmp_path / "c.jsonl"], tmp_path / "out", tok_dir, "--format", "chat") == 0
    ids, mask = documents(TokenDataset(tmp_path / "out"))[0]
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ref = hf.apply_chat_template(conv, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert ids == ref["input_ids"] and mask == [bool(m) for m in ref["assistant_masks"]]


@pytest.mark.parametrize("train_on", ["all", "last-assistant"])
def test_train_on(tmp_path, train_on):
    tok_dir = chat_tokenizer(tmp_path / "tok", CHATML)
    conv = CONVERSATIONS[0]
    write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}])
    assert prepare([tmp_path / "c.jsonl"], tmp_path / "out", tok_dir, "--format", "chat",
                   "--train-on", train_on) == 0
    ids, mask = documents(TokenDataset(tmp_path / "out"))[0]
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    kept = hf.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert kept == (hf.decode(ids) if train_on == "all" else "a big red fox.<|im_end|>\n")


def test_prompt_completion_plain_and_conversational(tmp_path):
    tok_dir = chat_tokenizer(tmp_path / "tok", CHATML)
    records = [{"prompt": "Q: the cat sat on", "completion": " the mat."},
               {"prompt": turns("the cat?"), "completion": turns("x", "the dog.")[1:]}]
    write_jsonl(tmp_path / "pc.jsonl", records)
    assert prepare([tmp_path / "pc.jsonl"], tmp_path / "out", tok_dir,
                   "--format", "prompt-completion") == 0
    (ids0, mask0), (ids1, mask1) = documents(TokenDataset(tmp_path / "out"))
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert ids0 == hf("Q: the cat sat on the mat.")["input_ids"] + [1]  # + end of document
    assert hf.decode([i for i, m in zip(ids0, mask0, strict=True) if m]) == " the mat.</s>"
    conv = records[1]["prompt"] + records[1]["completion"]
    assert ids1 == hf.apply_chat_template(conv, tokenize=True)["input_ids"]
    assert hf.decode([i for i, m in zip(ids1, mask1, strict=True) if m]) == \
        "the dog.<|im_end|>\n"


def test_manifest_mask_shards_and_verify(tmp_path):
    tok_dir = chat_tokenizer(tmp_path / "tok", CHATML)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS * 20])
    assert prepare([tmp_path / "c.jsonl"], tmp_path / "out", tok_dir, "--format", "chat",
                   "--chunk-mb", "0.002") == 0
    ds = TokenDataset(tmp_path / "out")
    manifest = ds.manifest
    assert len(manifest["shards"]) > 2 and ds.has_mask
    assert manifest["input_format"] == "chat"
    assert manifest["chat_template"]["sha256"] == hashlib.sha256(
        (tok_dir / "chat_template.jinja").read_bytes()).hexdigest()
    masks = [np.fromfile(tmp_path / "out" / s["mask_file"], np.uint8) for s in manifest["shards"]]
    flat = np.concatenate(masks)
    assert flat.size == manifest["num_tokens"]
    assert manifest["loss_mask"]["trained_tokens"] == int(flat.sum()) > 0
    assert manifest["loss_mask"]["masked_tokens"] == int((flat == 0).sum()) > 0
    for s, m in zip(manifest["shards"], masks, strict=True):
        assert s["mask_crc32"] == zlib.crc32(m.tobytes())
    a, b = int(ds.shard_starts[1]) - 5, int(ds.shard_starts[2]) + 5  # spans shards
    assert ds.mask(a, b).tolist() == flat[a:b].astype(bool).tolist()
    ds.verify()
    path = tmp_path / "out" / manifest["shards"][1]["mask_file"]
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"{path}: crc32 .* loss mask changed"):
        TokenDataset(tmp_path / "out").verify()
    path.write_bytes(bytes(raw[:-1]))
    with pytest.raises(DataError, match=f"{path}: missing or not .* loss-mask bytes"):
        TokenDataset(tmp_path / "out")


def test_text_datasets_have_no_mask_and_read_every_token_as_trained(tmp_path):
    tok_dir = chat_tokenizer(tmp_path / "tok", CHATML)
    (tmp_path / "a.txt").write_text("the cat sat.\n\nthe dog ran.\n")
    assert prepare([tmp_path / "a.txt"], tmp_path / "out", tok_dir) == 0
    ds = TokenDataset(tmp_path / "out")
    assert not ds.has_mask and ds.mask(0, 4).tolist() == [True] * 4
    assert not {"input_format", "loss_mask", "chat_template"} & set(ds.manifest)
    assert not list((tmp_path / "out").glob("mask-*"))


def test_chat_template_option_and_worker_processes(tmp_path):
    """A tokenizer without a template takes --chat-template FILE; 2 workers write the same."""
    tok_dir = chat_tokenizer(tmp_path / "tok", None)
    (tmp_path / "t.jinja").write_text(CHATML)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS * 10])
    outs = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        assert main(["prepare-data", str(tmp_path / "c.jsonl"), "--tokenizer", str(tok_dir),
                     "--out", str(out), "--format", "chat", "--chat-template",
                     str(tmp_path / "t.jinja"), "--workers", workers, "--chunk-mb",
                     "0.002"]) == 0
        outs.append(out)
    manifest = json.loads((outs[0] / "manifest.json").read_text())
    assert manifest["chat_template"]["origin"] == str(tmp_path / "t.jinja")
    for s in manifest["shards"]:
        for name in (s["file"], s["mask_file"]):
            assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()


def _bad(tmp_path, lines: list[str]) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"messages": turns("hi", "hello")})
BAD = {
    "unknown role": (CHATML, [GOOD, json.dumps({"messages": [{"role": "bot", "content": "x"}]})],
                     r"bad.jsonl:2: messages\[0\] has role 'bot'; expected one of system, "
                     "user, assistant, tool"),
    "not json": (CHATML, [GOOD, GOOD, "{oops"], r"bad.jsonl:3: not valid JSON"),
    "no messages": (CHATML, [json.dumps({"text": "x"})], r"bad.jsonl:1: no field 'messages'"),
    "content not a string": (CHATML, [json.dumps({"messages": [{"role": "user",
                                                                "content": 3}]})],
                             r"bad.jsonl:1: messages\[0\] 'content' is int, expected a string"),
    "no assistant": (CHATML, [json.dumps({"messages": turns("hi")})],
                     r"bad.jsonl:1: no assistant message \(nothing to train on with "
                     "--train-on assistant\\)"),
    "template raises": (MISTRAL, [GOOD, json.dumps({"messages": [SYSTEM, *turns("a", "b")]})],
                        r"bad.jsonl:2: the chat template \(.*chat_template.jinja\) refused the "
                        "conversation: Conversation roles must alternate"),
    "rewrites earlier turns": (QWEN3, [json.dumps({"messages": [
        *turns("a", "b"), *turns("c", "d")]}).replace('"content": "b"',
                                                      '"content": "b", "reasoning_content": "r"')],
        r"bad.jsonl:1: the chat template renders the turns before assistant message 1 "
        "differently once later messages follow"),
    # issue 38, item 11: each of these was a traceback
    "lone surrogate": (CHATML, [GOOD, json.dumps({"messages": turns("\ud800", "b")})],
                       r"bad.jsonl:2: messages\[0\] 'content' holds a lone surrogate "
                       r"\(U\+D800 at character 0\)"),
    "nested 100k deep": (CHATML, [GOOD, "[" * 100_000 + "]" * 100_000],
                         r"bad.jsonl:2: not valid JSON \(nested too deeply\)"),
    "template divides by zero": ("{{ 1 / 0 }}", [GOOD],
                                 r"bad.jsonl:1: the chat template \(.*chat_template.jinja\) "
                                 "failed on the conversation: ZeroDivisionError: division by "
                                 "zero"),
    "template adds a string to an int": ("{{ messages | length + 'a' }}", [GOOD],
                                         r"bad.jsonl:1: the chat template \(.*\) failed on the "
                                         "conversation: TypeError: unsupported operand"),
    "no template": (None, [GOOD], r"--tokenizer .*tok: the tokenizer has no chat template \(no "
                                  "chat_template.jinja, none in tokenizer_config.json\\); give "
                                  "one with --chat-template FILE"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_chat_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, case):
    template, lines, message = BAD[case]
    tok_dir = chat_tokenizer(tmp_path / "tok", template)
    code = prepare([_bad(tmp_path, lines)], tmp_path / "out", tok_dir, "--format", "chat")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("moezero: error: ") and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_bad_options_are_one_line(tmp_path, capsys):
    tok_dir = chat_tokenizer(tmp_path / "tok", CHATML)
    (tmp_path / "a.txt").write_text("x\n")
    assert prepare([tmp_path / "a.txt"], tmp_path / "o1", tok_dir, "--format", "chat") == 2
    assert "a.txt: --format chat reads .jsonl files" in capsys.readouterr().err
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }")
    write_jsonl(tmp_path / "c.jsonl", [{"messages": turns("a", "b")}])
    assert prepare([tmp_path / "c.jsonl"], tmp_path / "o2", tok_dir, "--format", "chat",
                   "--chat-template", str(tmp_path / "t.jinja")) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 't.jinja'}: chat template line 1:" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_prompt_completion_message_lists_need_a_template(tmp_path, capsys):
    tok_dir = chat_tokenizer(tmp_path / "tok", None)
    write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"},
                                        {"prompt": turns("a"), "completion": turns("x", "b")[1:]}])
    assert prepare([tmp_path / "pc.jsonl"], tmp_path / "out", tok_dir,
                   "--format", "prompt-completion") == 2
    err = capsys.readouterr().err
    assert "pc.jsonl:2: message lists need a chat template and the tokenizer has none" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


MIXTRAL = dict(vocab_size=320, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2, num_local_experts=2,
               num_experts_per_tok=1, max_position_embeddings=64, bos_token_id=0,
               eos_token_id=1, pad_token_id=2)


@pytest.mark.parametrize("legacy", [False, True], ids=["chat_template.jinja", "tokenizer_config"])
def test_import_hf_carries_the_chat_template(tmp_path, legacy):
    torch = pytest.importorskip("torch")
    hf_dir = chat_tokenizer(tmp_path / "hf", CHATML, legacy=legacy)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL)).save_pretrained(hf_dir)
    assert main(["import-hf", str(hf_dir), "--out", str(tmp_path / "ckpt")]) == 0
    carried = tmp_path / "ckpt" / "tokenizer" / (
        "tokenizer_config.json" if legacy else "chat_template.jinja")
    assert carried.read_bytes() == (hf_dir / carried.name).read_bytes()
    write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    assert prepare([tmp_path / "c.jsonl"], tmp_path / "out", tmp_path / "ckpt",
                   "--format", "chat") == 0
    ds = TokenDataset(tmp_path / "out")
    assert ds.manifest["chat_template"]["sha256"] == hashlib.sha256(CHATML.encode()).hexdigest()
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert [ids for ids, _ in documents(ds)] == [
        hf.apply_chat_template(c, tokenize=True)["input_ids"] for c in CONVERSATIONS]


def test_a_chat_dataset_passes_the_checks_before_training(tmp_path):
    """The training side does not use the mask yet; a chat dataset is accepted (its masks
    verified) and packs into samples like any other."""
    from moezero.config import load_config
    from moezero.data.build import check_data

    tok_dir = chat_tokenizer(tmp_path / "tok", CHATML)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS * 10])
    assert prepare([tmp_path / "c.jsonl"], tmp_path / "out", tok_dir, "--format", "chat") == 0
    cfg = load_config(None, [f"data.path={tmp_path / 'out'}", "train.seq_len=32",
                             "train.micro_batch_size=2", "model.vocab_size=320",
                             "data.val_fraction=0.1"])
    assert check_data(cfg).tokenizer.vocab_size == 311
    mask = tmp_path / "out" / "mask-00000.bin"
    mask.write_bytes(bytes([2]) + mask.read_bytes()[1:])
    with pytest.raises(DataError, match=f"{mask}: crc32"):
        check_data(cfg)
