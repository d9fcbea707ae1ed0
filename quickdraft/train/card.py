"""Model cards (README.md) for folders written by `quickdraft train` and `quickdraft distill`,
built from their training_log.json / distill_log.json: nothing in a card is typed by hand."""

from __future__ import annotations

import json
from pathlib import Path


def _arch(cfg: dict) -> str:
    return (f"Llama architecture: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} key/value heads), MLP "
            f"{cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}, context {cfg['max_position_embeddings']}, "
            f"tied embeddings: {cfg.get('tie_word_embeddings', False)}; weights stored in {cfg.get('torch_dtype')}.")


def _corpus(c: dict) -> str:
    src = "the Python standard library of the interpreter that trained it" if c.get("source") == "stdlib" else c.get("source")
    return (f"{src}: {c.get('files_train')} files for training, {c.get('files_heldout')} held out "
            "(chosen by a hash of the file path; never trained on)"
            + (f", {c['bytes'] / 1e6:.1f} MB" if c.get("bytes") else "") + ".")


def write_model_card(folder: str | Path, notes: str = "") -> Path:
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    train_log, distill_log = folder / "training_log.json", folder / "distill_log.json"
    lines: list[str] = []
    if distill_log.exists():
        log = json.loads(distill_log.read_text())
        a, b = log["acceptance_before"], log["acceptance_after"]
        args, data = log["args"], log.get("data", {})
        if args.get("instructions"):
            generated = (f"on the target's answers to {data.get('instructions')} chat instructions "
                         "(quickdraft/train/instructions.py, rendered with its chat template): "
                         f"{args['pool_prompts']} answers, the greedy one for each instruction and sampled ones "
                         f"(temperature 1) after, at most {args['pool_new_tokens']} tokens each, "
                         f"{data.get('pool_tokens', 0):,} tokens with the prompts")
        else:
            generated = (f"on {args['pool_prompts']} continuations the target generated "
                         "(half greedy, half sampled at temperature 1)")
        teacher = (f"the target's top-{args['teacher_topk']} log-probabilities and the mass of the rest, computed "
                   f"once (target in {args.get('teacher_dtype')}) for {args['teacher_windows']} fixed windows and "
                   "trained on for several epochs" if args.get("teacher_topk") else
                   f"the target's full distribution at every step (target in {args.get('teacher_dtype', 'float32')})")
        lines += [
            f"# quickdraft draft ({log['size']}), distilled from its target", "",
            f"Target: {log.get('target', log['target_dir'])}. "
            f"{log['params']:,} parameters ({log['params'] / log['target_params']:.1%} of the target's "
            f"{log['target_params']:,}, embeddings counted). " + _arch(cfg), "",
            "Trained to match the target's next-token distributions (forward KL, DistillSpec, arXiv 2310.08461) "
            f"on corpus windows and {generated}; same tokenizer as the target. Teacher signal: {teacher}. "
            + ("Initial embedding: the target's, projected on its leading singular vectors. "
               if args.get("init") == "target-embedding" else ""), "",
            f"- Corpus: {_corpus(log['corpus'])}",
            f"- Steps: {log['steps']} x {args['batch_size']} windows of {args['seq_len']} tokens "
            f"= {log['tokens_seen']:,} tokens seen ({args['generated_fraction']:.0%} target-generated); "
            f"final KL {log['final_kl']:.4f}.",
            f"- Held-out loss (next-token cross-entropy on held-out corpus files, nats): draft "
            f"{log['heldout_loss']:.4f}, target {log['target_heldout_loss']:.4f}.",
            f"- Acceptance against the target (greedy, k={b['k']}, {log['eval_prompts']} "
            f"{log.get('eval_kind', 'held-out function/class openings')}, {log.get('eval_new_tokens', 64)} new tokens "
            f"at most): {a['acceptance_rate']:.3f} before distillation (mean acceptance length "
            f"{a['mean_acceptance_length']:.2f}), {b['acceptance_rate']:.3f} after ({b['mean_acceptance_length']:.2f}).",
            f"- Wall time: {log['wall_time_s'] / 60:.1f} min (target answers {log.get('pool_time_s', 0) / 60:.1f}, "
            f"target top-k {log.get('teacher_time_s', 0) / 60:.1f}, training {log['train_time_s'] / 60:.1f}) on "
            f"{log['device']}" + (f", {log['threads']} thread(s), {log.get('cpu')}" if log.get("threads") else "")
            + f" (torch {log['versions']['torch']}).",
        ]
        command = log.get("command")
    else:
        log = json.loads(train_log.read_text())
        args = log["args"]
        lines += [
            f"# quickdraft target ({log['size']}), pretrained from scratch", "",
            f"{log['params']:,} parameters. " + _arch(cfg), "",
            f"- Corpus: {_corpus(log['corpus'])} Tokens: {log['corpus']['tokens_train']:,} train, "
            f"{log['corpus']['tokens_heldout']:,} held out; byte-level BPE with {log['tokenizer']['vocab_size']} "
            "tokens trained on the train split.",
            f"- Steps: {log['step']} x {args['batch_size'] * args['grad_accum']} windows of {args['seq_len']} tokens "
            f"= {log['tokens_seen']:,} tokens seen; AdamW, peak learning rate {args['lr']}, warmup "
            f"{args['warmup']} steps, cosine decay to 10%; bf16 autocast: {log['bf16_autocast']}.",
            f"- Held-out loss (next-token cross-entropy, nats): {log['heldout_loss']:.4f}.",
            f"- Training time: {log['train_time_s'] / 60:.1f} min on {log['device']} "
            f"({log['tokens_per_second']:,.0f} tokens/s; torch {log['versions']['torch']}).",
        ]
        command = log.get("command")
    lines += ["", "Reproduce:", "", "```", command or "(command not recorded)", "```"]
    if notes:
        lines += ["", notes]
    path = folder / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
