"""Every ``moezero`` subcommand end to end through an installed wheel (``nox -s wheel``).

    cd $(mktemp -d) && python -I /path/to/tests/wheel/smoke.py

Run with ``-I`` from a folder outside the repository, in a venv holding the wheel (not an
editable install) with torch and the ``hf`` extra only: the repository is not on
``sys.path``, so this sees the installed distribution only (it imports nothing from tests/).
In the current folder it

1. trains a byte-level BPE with ``tokenizers`` (offline) and ``prepare-data``s a small corpus,
2. ``train``s a tiny decoder on it (W = 2, ep 2, 3 steps) and ``estimate``s that config and a
   packaged recipe by name (``--config qwen3-moe-30b-a3b-lora``); ``moezero recipes``,
3. ``checkpoint inspect``, ``verify``, ``export`` (moezero) and ``export --format hf`` the run,
   and loads the export with ``from_pretrained``: no missing or unexpected keys, logits within
   1e-5 of moezero's decoder on the same checkpoint,
4. for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE: a tiny random model saved with
   ``save_pretrained``, ``import-hf``, ``verify``, ``export --format hf`` and
   ``from_pretrained`` again: the logits within 1e-5 of the source model's; the same for
   gpt-oss, GLM-4.5 and DeepSeek-V3, then each fine-tuned with LoRA on attention, exported with
   ``--format peft`` and ``--merge-lora``: ``peft`` loads the adapter on the hf export with the
   merged model's logits (within 1e-5),
5. the README's "Fine-tune" example, its commands read from README.md (so the README cannot
   drift from what CI runs), as written: ``moezero example tiny-hf .`` (a tiny random
   Qwen3-MoE with a tokenizer and ChatML template, and a chat corpus, made offline), import-hf,
   prepare-data --format chat, LoRA train, export --format hf / peft / --merge-lora, then its
   Python block (PEFT and transformers load the exports, with no PEFT warning); the PEFT
   model's logits equal the merged model's within 1e-5 and differ from the base's.

The LoRA families of step 4 run in a second process beside the rest (``--lora-families``,
one torch thread, its lines printed when it ends): the two halves take about as long.

Prints one line per step; exits non-zero at the first failure with the command's stderr.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ATOL = 1e-5  # fp32 logits, as tests/torch_impl/test_hf_families.py
MOEZERO = str(Path(sys.executable).parent / "moezero")
REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=48", "--set", "model.vocab_size=320",
        "--set", "moe.num_experts=4", "--set", "moe.ep_size=2", "--set", "train.seq_len=32",
        "--set", "train.micro_batch_size=2", "--set", "train.eval_every=0"]
TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rms_norm_eps=1e-6)
FAMILIES = {  # model_type: (config class, model class, its own config fields)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, num_experts=4, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                       head_dim=12, norm_topk_prob=True, tie_word_embeddings=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=48, num_experts=4, norm_topk_prob=False,
                   pad_token_id=1, eos_token_id=2)),
}
LORA_FAMILIES = {  # issue 36's families: import, export, then LoRA -> PEFT export -> peft loads
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, head_dim=8, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 4.0,
                                      "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False})),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
                      n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                      routed_scaling_factor=2.0, norm_topk_prob=True, head_dim=8,
                      partial_rotary_factor=0.5, attention_bias=True,
                      num_hidden_layers=3)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
                         n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                         routed_scaling_factor=2.0, norm_topk_prob=True, q_lora_rank=16,
                         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                         num_key_value_heads=4, num_hidden_layers=3)),
}
FAMILIES.update(LORA_FAMILIES)


def moezero(*args: str, timeout: float = 300) -> str:
    start = time.monotonic()
    res = subprocess.run([MOEZERO, *args], capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        sys.exit(f"FAILED (exit {res.returncode}): moezero {' '.join(args)}\n"
                 f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    print(f"ok {time.monotonic() - start:5.1f}s  moezero {' '.join(args)}", flush=True)
    return res.stdout


def check(ok: bool, what: str) -> None:
    if not ok:
        sys.exit(f"FAILED: {what}")
    print(f"ok         {what}", flush=True)


def installed() -> None:
    import moezero as package  # not the moezero() command runner above

    where = Path(package.__file__).resolve()
    check(where.parents[1].name == "site-packages",  # an editable install: torch_impl/
          f"moezero imports from the installed wheel ({where.parent})")
    check(moezero("--version").strip().startswith("moezero "), "moezero --version")
    out = moezero("docs")
    check(f"documentation pages in {where.parent / 'docs'}" in out and "\nfinetune " in out,
          "moezero docs: the pages installed with the wheel")


def tokenizer(folder: Path, corpus: Path, specials: tuple | list = ()) -> None:
    """A byte-level BPE trained on a generated corpus (offline), as a model folder holds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = "the a cat dog fox sat ran saw on under mat tree house river and then".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(400)]
    corpus.write_text("\n\n".join(docs) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<pad>", *specials], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "<pad>"}))


def moezero_logits(ckpt: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The installed decoder (all experts local) on the checkpoint's fp32 masters."""
    from moezero.config import Config
    from moezero.model.build import config_decoder
    from moezero.plan import store

    step = store.find_checkpoint(ckpt)
    manifest = store.read_manifest(step)
    cfg = Config.model_validate(manifest.config)
    cfg.moe.ep_size = 1
    model = config_decoder(cfg, where="cpu", adapters=False, init=False).eval()
    tensors = store.read_tensors(step, manifest)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    with torch.no_grad():
        return model(tokens)[0]


def from_pretrained(folder: Path):
    """The export loaded by transformers: every key matched, nothing left over."""
    import transformers

    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    cls = getattr(transformers, FAMILIES[model_type][1])
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k != "error_msgs" and v}
    check(not bad, f"from_pretrained({folder.name}) as {cls.__name__}: no missing, "
                   f"unexpected or mismatched keys {bad or ''}")
    return model.eval()


def close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    diff = (ours - theirs).abs().max().item()
    check(diff <= ATOL, f"{what}: logits max abs diff {diff:.2e} <= {ATOL:.0e}")


def trained_run(work: Path) -> None:
    tokenizer(work / "tok", work / "corpus.txt")
    moezero("prepare-data", str(work / "corpus.txt"), "--tokenizer", str(work / "tok"),
            "--out", str(work / "data"), "--workers", "1")
    out = moezero("train", "--nproc", "2", "--data", str(work / "data"), *TINY,
                  "--set", "train.steps=3", "--out", str(work / "run"))
    check("step_00000003" in out, "train saved step_00000003")
    moezero("estimate", "--nproc", "2", "--device", "cpu", *TINY)
    out = moezero("estimate", "--config", "qwen3-moe-30b-a3b-lora", "--nproc", "8",
                  "--set", "checkpoint.load=null")
    check("peak device" in out, "--config qwen3-moe-30b-a3b-lora: the packaged recipe by name")
    out = moezero("recipes")
    check("qwen3-moe-30b-a3b-lora " in out, "moezero recipes lists the packaged recipes")
    ckpts = str(work / "run" / "checkpoints")
    moezero("checkpoint", "inspect", ckpts)
    moezero("checkpoint", "verify", ckpts)
    moezero("checkpoint", "export", ckpts, "--dtype", "bf16", "--out", str(work / "flat"))
    out = moezero("checkpoint", "export", ckpts, "--format", "hf", "--out", str(work / "hf"))
    check("as hf-mixtral fp32" in out, "the built-in decoder exports as hf-mixtral")
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = from_pretrained(work / "hf")(tokens).logits
    close(moezero_logits(work / "run" / "checkpoints", tokens), theirs, "trained run export")


def hf_model(family: str, **fields):
    """A tiny random model, every tensor random so each one shows in the logits."""
    import transformers

    config_cls, model_cls, own = FAMILIES[family]
    # a deep copy: a config class may edit the rope_parameters dict it is given, in place
    cfg = getattr(transformers, config_cls)(**copy.deepcopy({**BASE, **own, **fields}))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


def hf_round_trip(work: Path, family: str) -> None:
    source = hf_model(family)
    source.save_pretrained(work / f"{family}-src", max_shard_size="50KB")
    ckpt, out = work / f"{family}-ckpt", work / f"{family}-hf"
    moezero("import-hf", str(work / f"{family}-src"), "--out", str(ckpt))
    moezero("checkpoint", "verify", str(ckpt))
    moezero("checkpoint", "export", str(ckpt), "--format", "hf", "--out", str(out))
    with torch.no_grad():
        theirs = source(TOKENS).logits
        back = from_pretrained(out)(TOKENS).logits
    close(moezero_logits(ckpt, TOKENS), theirs, f"{family} import vs transformers")
    close(back, theirs, f"{family} import + export vs transformers")


def lora_peft_round_trip(work: Path, family: str) -> None:
    """An imported family fine-tuned with LoRA on attention, exported with --format peft and
    --merge-lora: peft loads the adapter on the hf export with the merged model's logits."""
    import peft

    hf_round_trip(work, family)
    ckpt, run = work / f"{family}-ckpt", work / f"{family}-lora"
    moezero("train", "--nproc", "1", "--config", str(ckpt / "config.yaml"),
            "--set", "moe.ep_size=1", "--set", "peft.method=lora", "--set", "peft.r=4",
            "--set", "peft.targets=[attn]", "--set", "train.steps=2", "--set",
            "train.seq_len=12", "--set", "train.micro_batch_size=2", "--set",
            "optimizer.lr=3e-2", "--set", "moe.bias_update_rate=0",  # PEFT holds no bias
            "--out", str(run))
    moezero("checkpoint", "export", str(run / "checkpoints"), "--format", "peft",
            "--out", str(work / f"{family}-peft"))
    moezero("checkpoint", "export", str(run / "checkpoints"), "--merge-lora", "--format", "hf",
            "--out", str(work / f"{family}-merged"))
    model = peft.PeftModel.from_pretrained(from_pretrained(work / f"{family}-hf"),
                                           work / f"{family}-peft").eval()
    with torch.no_grad():
        merged = from_pretrained(work / f"{family}-merged")(TOKENS).logits
        close(model(TOKENS).logits, merged, f"{family}: PEFT adapter vs --merge-lora export")
        with model.disable_adapter():
            moved = (model(TOKENS).logits - merged).abs().max().item()
    check(moved > 1e-4, f"{family}: the adapters moved the logits ({moved:.1e})")


def readme_example() -> tuple[list[list[str]], str]:
    """The README's "Fine-tune" section: its ``sh`` block's commands (continued lines joined)
    and its ``python`` block."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Fine-tune\n", 1)[1].split("\n## ", 1)[0]
    shell = re.search(r"```sh\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line) for line in shell.splitlines() if line.strip()], python


def finetune_example(work: Path) -> None:
    commands, python = readme_example()
    check(len(commands) == 7 and all(c[0] == "moezero" for c in commands),
          "the README's Fine-tune example: 7 moezero commands")
    check(commands[0] == ["moezero", "example", "tiny-hf", "."],
          "it starts from the tiny model made here (moezero example tiny-hf)")
    for command in commands:
        out = moezero(*command[1:])
        if "peft" in command:
            note = "moezero: note: loading this adapter, PEFT warns that the rank_pattern"
            check(out.startswith(note), "export --format peft says PEFT's warning is expected")
    space: dict = {}
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(python, "README.md (Fine-tune)", "exec"), space)
    print(f"ok {time.monotonic() - start:5.1f}s  the README's Python block", flush=True)
    peft_warnings = [str(w.message) for w in caught if "peft" in w.filename]
    check(all("pattern keys did not match" in w and "gate_up_proj" in w for w in peft_warnings),
          f"PEFT warns only what moezero's export announced ({len(peft_warnings)} warnings)")
    ids = space["ids"]
    with torch.no_grad():
        merged, adapted = space["merged"](ids).logits, space["adapted"](ids).logits
        base = space["adapted"].get_base_model()
        with space["adapted"].disable_adapter():
            plain = base(ids).logits
    close(adapted, merged, "PEFT adapter vs --merge-lora export")
    moved = (plain - merged).abs().max().item()
    check(moved > 1e-4, f"the adapters moved the logits ({moved:.1e})")


def beside(work: Path) -> tuple[subprocess.Popen, Path]:
    """This script's LoRA-family half (``--lora-families``) in a process of its own, in a
    subfolder, at one torch thread, while this process runs the rest: the two halves take
    about as long, so on 2 cores the smoke takes about half as long. Its output is printed
    when it ends (``joined``)."""
    folder = work / "lora-families"
    folder.mkdir()
    log = folder / "smoke.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-I", str(Path(__file__).resolve()),
                                 "--lora-families"], cwd=folder, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    return proc, log


def joined(proc: subprocess.Popen, log: Path) -> None:
    code = proc.wait(timeout=1800)
    print(f"--- the LoRA families (run beside the rest):\n{log.read_text()}", end="", flush=True)
    check(code == 0, f"the LoRA families' half (exit {code})")


def main() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    work = Path.cwd()
    check(REPO not in [work, *work.parents], f"working in {work}, outside the repository")
    if sys.argv[1:] == ["--lora-families"]:
        for family in LORA_FAMILIES:
            lora_peft_round_trip(work, family)
        return
    installed()
    start = time.monotonic()
    proc, log = beside(work)
    try:
        trained_run(work)
        for family in FAMILIES:
            if family not in LORA_FAMILIES:
                hf_round_trip(work, family)
        finetune_example(work)
    except BaseException:  # a failed check exits: not without the other half
        proc.kill()
        raise
    joined(proc, log)
    print(f"wheel smoke passed: every subcommand, {time.monotonic() - start:.0f}s")


if __name__ == "__main__":
    main()
