"""The ``finetune`` series: LoRA and full SFT in moezero beside TRL ``SFTTrainer`` + PEFT +
DeepSpeed ZeRO-3 (issue 26), on the same chat data at W = 2, for a tiny Qwen3-MoE and for
models of the gpt-oss, DeepSeek-V3 and Qwen3-Next shapes (issues 36, 37;
``benchmarks.finetune_models``).

``python -m benchmarks.run --series finetune --peer-python PATH [--only FAMILY] [--repeats N]``
(``nox -s bench -- --series finetune``; not in CI): builds its inputs offline under the work
directory (``moezero.examples.tiny_hf``: tokenizer + chat template, conversations; a random HF
folder per family), ``moezero import-hf`` and ``moezero prepare-data --format chat`` them,
then runs each row in fresh ``torchrun`` processes: moezero's (``benchmarks.finetune_rank``)
with this interpreter, the peer's (``benchmarks.finetune_peer``) with ``--peer-python``. Every
row runs ``--repeats`` times (default 2), interleaved: all rows once, then all again.
``--only`` keeps the families whose key or label contains its text (e.g. ``gpt-oss``) and,
when a text is part of a moezero row's name (e.g. ``stage 0``), those rows only.
Rewrites only the sections of the families that ran (``benchmarks.finetune_report``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import finetune_families, finetune_models, finetune_report
from benchmarks.fmt import write_section
from benchmarks.launch import REPO, error_line, torchrun
from benchmarks.machine import machine_info
from moezero.examples import tiny_hf as finetune_data

_MODEL = {"dim": 256, "ffn_dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
          "num_experts": 8, "top_k": 2, "aux_loss_coef": 0.001}
_TRAIN = {"seq_len": 256, "micro_batch_size": 4, "lr": 1e-3, "seed": 0, "r": 16, "alpha": 32}
SIZES = {"full": {"model": _MODEL, "train": {**_TRAIN, "warmup": 3, "timed": 10},
                  "chats": 400, "max_words": 140, "vocab": 512},
         "quick": {"model": _MODEL, "train": {**_TRAIN, "warmup": 2, "timed": 4},
                   "chats": 400, "max_words": 140, "vocab": 512}}
"""Model (``n_kv_heads``: GQA; ``aux_loss_coef``: the router loss both sides add), loop and
data per mode. ``max_words`` keeps every conversation under ``seq_len`` tokens (checked)."""

LORA = ("peft.method=lora", "peft.r={r}", "peft.alpha={alpha}", "peft.dropout=0.0",
        "peft.targets=[attn, experts]")
ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("moezero LoRA, stage 0", ("zero_optimization.stage=0", *LORA)),
    ("moezero LoRA, stage 2", ("zero_optimization.stage=2", *LORA)),
    ("moezero LoRA, stage 3", ("zero_optimization.stage=3", *LORA)),
    ("moezero full SFT, stage 2", ("zero_optimization.stage=2",)),
]
"""moezero rows: (name, overrides beyond the shared ones of ``moezero_overrides``)."""
PEER = "TRL SFTTrainer + PEFT + DeepSpeed ZeRO-3, LoRA"
FAMILY_ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("moezero LoRA, stage 0", ("zero_optimization.stage=0",)),
    ("moezero LoRA, stage 3", ("zero_optimization.stage=3",)),
]
"""The moezero rows of the other families (``finetune_models.FAMILIES``), each with that
family's LoRA targets."""


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "moezero.cli", *args], capture_output=True,
                          text=True, check=False, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"moezero {args[0]}: {error_line(done.stdout + done.stderr)}")
    return done.stdout


def prepare_family(root: Path, family: str, size: dict, vocab: int) -> dict:
    """``family``'s random HF folder (the series' tokenizer beside it) and its import."""
    hf = root / family / "hf"
    finetune_data.save_tokenizer(hf, size["vocab"])
    params = finetune_models.save(hf, family, size["model"], vocab, size["train"]["seed"])
    _cli("import-hf", str(hf), "--out", str(root / family / "base"))
    return {"hf": str(hf), "base": str(root / family / "base"), "params": params}


def prepare(work: Path, size: dict) -> dict:
    """The Qwen3-MoE HF folder, the imported base checkpoint, the conversations and their
    prepared dataset (fresh each run, shared by every family: one tokenizer); their paths and
    counts."""
    root = work / "finetune"
    shutil.rmtree(root, ignore_errors=True)
    hf, chats = root / "hf", root / "chats.jsonl"
    vocab = finetune_data.save_tokenizer(hf, size["vocab"])
    params = finetune_data.save_model(hf, size["model"], vocab, size["train"]["seed"])
    finetune_data.write_jsonl(finetune_data.conversations(size["chats"], 0, size["max_words"]),
                              chats)
    _cli("import-hf", str(hf), "--out", str(root / "base"))
    _cli("prepare-data", str(chats), "--tokenizer", str(root / "base"), "--format", "chat",
         "--out", str(root / "data"))
    manifest = json.loads((root / "data" / "manifest.json").read_text())
    longest = finetune_report.longest_document(root / "data")
    if longest > size["train"]["seq_len"]:
        raise RuntimeError(f"a conversation of {longest} tokens exceeds seq_len "
                           f"{size['train']['seq_len']}: lower max_words")
    return {"root": str(root), "hf": str(hf), "chats": str(chats), "vocab": vocab,
            "params": params, "documents": manifest["num_documents"],
            "tokens": manifest["num_tokens"], "longest": longest,
            "trained": manifest["loss_mask"]["trained_tokens"]}


def moezero_overrides(inputs: dict, train: dict, extra: tuple[str, ...],
                      base: str | None = None, aux_loss_coef: float | None = None) -> list[str]:
    """The ``--set`` items of a moezero row: the base (``base``, default the Qwen3-MoE one)
    and data, the shared loop, fp32, constant lr, AdamW as the peer's (betas 0.9/0.999, no
    decay, clip 1.0), no validation."""
    root = inputs["root"]
    aux = _MODEL["aux_loss_coef"] if aux_loss_coef is None else aux_loss_coef
    shared = [f"checkpoint.load={base or root + '/base'}", f"data.path={root}/data",
              "data.val_fraction=0", "data.document_mask=true", "train.eval_every=0",
              f"train.seq_len={train['seq_len']}",
              f"train.micro_batch_size={train['micro_batch_size']}",
              f"train.steps={train['warmup'] + train['timed']}", f"train.seed={train['seed']}",
              "moe.ep_size=2", f"moe.aux_loss_coef={aux}",
              "moe.z_loss_coef=0", "precision.dtype=fp32", f"optimizer.lr={train['lr']}",
              "optimizer.warmup_steps=0", "optimizer.min_lr_ratio=1.0",
              "optimizer.weight_decay=0.0", "optimizer.betas=[0.9, 0.999]",
              "optimizer.gradient_clipping=1.0"]
    return shared + [item.format(**train) for item in extra]


def launch(python: str, module: str, spec: dict, tag: str, work: Path, timeout: float) -> dict:
    """One row in fresh ``torchrun`` processes (W = 2, one thread each); the parsed result,
    or ``{"status": "failed", "error": line}``."""
    base = work / "finetune" / "runs"
    base.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "ckpt_dir": str(base / f"{tag}-ckpt")}
    paths = {k: base / f"{tag}.{k}" for k in ("spec", "result", "log")}
    paths["spec"].write_text(json.dumps(spec))
    rc, wall = torchrun(python, module, 2, paths, timeout)
    if isinstance(rc, str):
        return {"status": "failed", "error": rc[:300]}
    if rc or not paths["result"].exists():
        return {"status": "failed", "error": error_line(paths["log"].read_text()), "wall_s": wall}
    return {"status": "ok", **json.loads(paths["result"].read_text()), "wall_s": wall}


def selected(only: list[str]) -> list[str]:
    """The family keys ``--only`` keeps: key or label containing a text (all when no text
    names a family)."""
    names = {k: f"{k} {f.label}".lower() for k, f in finetune_models.FAMILIES.items()}
    picked = [k for k, name in names.items() if any(t.lower() in name for t in only)]
    return picked or list(names)


def family_rows(family: str, inputs: dict, fam: dict, train: dict,
                only: list[str] = ()) -> list[tuple]:
    """(name, python, module, spec) of each row of ``family`` that ``only`` keeps
    (``keep_row``), the peer last."""
    spec = finetune_models.FAMILIES[family]
    peer = {**train, "model_dir": fam["hf"], "chats": inputs["chats"],
            "target_modules": list(spec.peer_modules),
            "target_parameters": list(spec.peer_parameters)}
    if not spec.peer_packs:  # one conversation per row: about moezero's tokens per micro-batch
        peer.update(packing=False, micro_batch_size=unpacked_batch(inputs, train))
    if family == "qwen3_moe":
        rows = ROWS
    else:
        lora = tuple(x for x in LORA if not x.startswith("peft.targets"))
        targets = f"peft.targets=[{', '.join(spec.targets)}]"
        rows = [(name, (*extra, *lora, targets, *spec.moezero_extra))
                for name, extra in FAMILY_ROWS]
    aux = None if spec.aux_loss else 0.0
    out = [(name, sys.executable, "benchmarks.finetune_rank",
            {"warmup": train["warmup"], "timed": train["timed"],
             "overrides": moezero_overrides(inputs, train, extra, fam["base"], aux)})
           for name, extra in rows if keep_row(name, [n for n, _ in rows], only)]
    return out + [(PEER, "peer", "benchmarks.finetune_peer", peer)]


def keep_row(name: str, names: list[str], only: list[str]) -> bool:
    """Whether a moezero row runs: every row, unless an ``--only`` text names some of the
    family's rows (e.g. ``stage 0``); then the rows it names."""
    naming = [t for t in only if any(t in n for n in names)]
    return not naming or any(t in name for t in naming)


def unpacked_batch(inputs: dict, train: dict) -> int:
    """Conversations per micro-batch of an unpacked peer: about the tokens of moezero's
    micro-batch (rows × seq len) at the data's mean conversation length."""
    mean = inputs["tokens"] / inputs["documents"]
    return max(1, round(train["micro_batch_size"] * train["seq_len"] / mean))


def measure(args, work: Path, size: dict) -> dict:
    """Inputs, then every row of every selected family ``repeats`` times, interleaved (all
    rows once, then again); each row's runs under ``repeats``."""
    inputs, train = prepare(work, size), size["train"]
    families, only = {}, getattr(args, "only", [])
    for family in selected(only):
        fam = ({"hf": inputs["hf"], "base": inputs["root"] + "/base",
                "params": inputs["params"]} if family == "qwen3_moe"
               else prepare_family(Path(inputs["root"]), family, size, inputs["vocab"]))
        families[family] = {**fam, "rows": family_rows(family, inputs, fam, train, only),
                            "runs": {}}
    for rep in range(getattr(args, "repeats", None) or 2):
        for family, fam in families.items():
            for name, python, module, spec in fam["rows"]:
                tag = f"{family}-{finetune_report.slug(name)}-{rep}"
                run = launch(args.peer_python if python == "peer" else python, module, spec,
                             tag, work, args.timeout)
                fam["runs"].setdefault(name, {"repeats": []})["repeats"].append(run)
                print(f"{family} {name} [{rep}]: {finetune_report.progress(run)}", flush=True)
    for fam in families.values():
        del fam["rows"]
    return {"inputs": inputs, "size": size, "families": families}


def run_only(args, out: Path, work: Path, quick: bool) -> int:
    """``--series finetune``: measure, keep the JSON, rewrite only the sections of the
    families that ran (with ``--from-json``: render that ``results-finetune.json`` instead,
    measuring nothing)."""
    start = time.perf_counter()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = {"machine": machine_info(), "command": "python -m benchmarks.run "
                   + shlex.join(sys.argv[1:]), "load_before": os.getloadavg(),
                   "uptime_before": _uptime(),
                   "finetune": measure(args, work, SIZES["quick" if quick else "full"]),
                   "load_after": os.getloadavg(), "uptime_after": _uptime()}
        for fam in results["finetune"]["families"].values():
            fam["run"] = {k: results[k] for k in ("command", "uptime_before", "uptime_after")}
            fam["run"]["date"] = results["machine"]["date"]
        results = merged(work / "results-finetune.json", results)
        (work / "results-finetune.json").write_text(json.dumps(results, indent=1))
    for section in sections(results):
        write_section(out, section, "finetune", start)
    return 0


def merged(previous: Path, results: dict) -> dict:
    """``results`` with the families of the ``previous`` results of the same sizes that did
    not run now (``--only`` runs of one family at a time make one section; each family keeps
    its own command and load lines)."""
    if not previous.exists():
        return results
    old = json.loads(previous.read_text())["finetune"]
    if old.get("size") != results["finetune"]["size"] or "families" not in old:
        return results
    fams = {**old["families"], **results["finetune"]["families"]}
    order = list(finetune_models.FAMILIES)
    results["finetune"]["families"] = dict(sorted(fams.items(), key=lambda kv: order.index(kv[0])))
    return results


def sections(results: dict) -> list[list[str]]:
    """The BENCHMARKS.md sections of the families in ``results``: Qwen3-MoE's, then the
    other families' (``benchmarks.finetune_families``)."""
    fams = finetune_report.family_runs(results)
    out = [finetune_report.section(results)] if "qwen3_moe" in fams else []
    if any(k in fams for k in finetune_families.KEYS):
        out.append(finetune_families.section(results))
    return out


def _uptime() -> str:
    """``uptime``'s line (the machine is shared: the report records the load around a run)."""
    done = subprocess.run(["uptime"], capture_output=True, text=True, check=False)
    return done.stdout.strip()
