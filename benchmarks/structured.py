"""Structured output under speculation (issue 32, item 7): plain constrained vs speculative
constrained decoding, and llama.cpp's JSON-schema grammar on the same weights.

Workloads, generated deterministically from templates here (held out from any tuning):
  extraction      a text that states a person's / an order's / an event's fields, and a schema
                  for them (varied fields, enums, integers, arrays, nested objects, patterns): the
                  values are in the prompt, so suffix / n-gram proposals can copy them. Strings are
                  bounded (maxLength, bounded patterns), as a schema for a model's output should
                  be: an unbounded string lets a looping model write until max_tokens
  classification  a review or a support ticket, answered as one of an enum (a choice list)
  tools           a request for one of two functions, through the chat template with `tools` and
                  tool_choice "required" (the server's own constraint and parser, server/tools.py)

For each model (SmolLM2 through its chat template; the bundled code target on raw text) every
method runs every task greedily, the methods interleaved task by task (one warm-up task first).
Reported per method: decode tok/s (first output token to the last, as benchmarks/llamacpp.py),
the speedup over plain constrained decoding, tokens per step, forced tokens per request, the
share of valid outputs (JSON that parses and validates, an enum member, a parsed tool call),
whether every output equals plain decoding's, and the constraint's share of the run (the
engine's mask and forced-token work, Engine._constrain + Engine._forced, timed around them).
llama.cpp: llama-completion with --json-schema-file (its json_schema_to_grammar) on the F32
GGUF of the same weights, the same rendered prompt, greedy (benchmarks/llamacpp.py's Peer).

    python benchmarks/structured.py --models smollm2 --out benchmarks/results/structured_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402

from quickdraft import LLM, QuickdraftError, SamplingParams  # noqa: E402
from quickdraft.bench.hardware import cpu_model, git_commit, loadavg, provenance, provenance_line, steady_steps  # noqa: E402
from quickdraft.engine import Engine  # noqa: E402
from quickdraft.server import tools as toolcalls  # noqa: E402

# --- tasks ------------------------------------------------------------------------------------------

FIRST = ["Maria", "Kenji", "Amara", "Lukas", "Sofia", "Ravi", "Elena", "Tomas", "Aisha", "Pierre", "Mei", "Jonas"]
LAST = ["Lopez", "Tanaka", "Okafor", "Weber", "Rossi", "Patel", "Ivanova", "Novak", "Khan", "Dubois", "Chen"]
CITIES = ["Lisbon", "Osaka", "Lagos", "Berlin", "Milan", "Pune", "Sofia", "Prague", "Karachi", "Lyon", "Oslo"]
JOBS = ["nurse", "engineer", "teacher", "pilot", "chef", "lawyer", "designer", "farmer"]
PRODUCTS = ["desk lamp", "office chair", "coffee grinder", "rain jacket", "bike helmet", "water bottle",
            "backpack", "phone case", "yoga mat", "kettle"]
STATUSES = ["pending", "shipped", "delivered", "cancelled"]
EVENTS = ["concert", "conference", "workshop", "wedding", "marathon", "exhibition"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]
REVIEW = {"positive": ["I love this {p}, it works perfectly and arrived early.",
                       "The {p} is excellent value, I would buy it again."],
          "negative": ["The {p} broke after two days and support never answered.",
                       "Terrible {p}: it arrived damaged and smells of plastic."],
          "neutral": ["The {p} is fine, nothing special, it does what it says.",
                      "The {p} arrived on time. It is an ordinary {p}."]}
TICKET = {"billing": "I was charged twice for my {p} order, please refund one payment.",
          "shipping": "My {p} has not arrived yet, the tracking has not moved for a week.",
          "technical": "The {p} will not turn on after the latest firmware update.",
          "account": "I cannot log in to my account to check the {p} warranty."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                         "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table",
          "parameters": {"type": "object", "properties": {"restaurant": {"type": "string", "maxLength": 40},
                                                          "people": {"type": "integer", "minimum": 1, "maximum": 20},
                                                          "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
                         "required": ["restaurant", "people", "time"], "additionalProperties": False}}}]


@dataclass
class Task:
    name: str
    workload: str
    messages: list[dict]  # the user's request (chat models: through the template; others: its text)
    constraint: dict  # SamplingParams.constraint
    schema: dict | None = None  # what a valid answer validates against (extraction)
    choices: list[str] | None = None  # classification
    tools: list[dict] | None = None  # tool calling
    max_tokens: int = 160


def _person(r: random.Random, i: int) -> Task:
    name, city, job, age = f"{r.choice(FIRST)} {r.choice(LAST)}", r.choice(CITIES), r.choice(JOBS), r.randint(19, 80)
    langs = r.sample(["English", "Spanish", "Japanese", "German", "Hindi", "French"], r.randint(1, 3))
    fields = {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
              "city": {"type": "string", "maxLength": 40}, "occupation": {"enum": JOBS}}
    text = f"{name} is a {age}-year-old {job} who lives in {city}."
    if i % 2:
        fields["languages"] = {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4}
        text += f" {name.split()[0]} speaks {' and '.join(langs)}."
    if i % 3 == 0:
        fields["email"] = {"type": "string", "pattern": "^[a-z.]{1,40}@[a-z]{1,20}\\.com$"}
        text += f" Contact: {name.lower().replace(' ', '.')}@example.com."
    return _extraction(f"person{i}", "person", text, fields)


def _order(r: random.Random, i: int) -> Task:
    oid, product, qty = f"ORD-{r.randint(10000, 99999)}", r.choice(PRODUCTS), r.randint(1, 9)
    price, status, city = round(r.uniform(5, 300), 2), r.choice(STATUSES), r.choice(CITIES)
    fields = {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{5}$"}, "product": {"type": "string", "maxLength": 40},
              "quantity": {"type": "integer", "minimum": 1}, "status": {"enum": STATUSES}}
    text = f"Order {oid}: {qty} x {product}, status {status}."
    if i % 2 == 0:
        fields["unit_price"] = {"type": "number"}
        text += f" Each costs {price} euros."
    if i % 3 == 1:
        fields["ship_to"] = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "express": {"type": "boolean"}},
                             "required": ["city", "express"], "additionalProperties": False}
        text += f" Ship to {city}, {'express' if i % 2 else 'standard'} delivery."
    return _extraction(f"order{i}", "order", text, fields)


def _event(r: random.Random, i: int) -> Task:
    kind, city, month, day = r.choice(EVENTS), r.choice(CITIES), r.choice(MONTHS), r.randint(1, 28)
    guests, host = r.randint(10, 900), f"{r.choice(FIRST)} {r.choice(LAST)}"
    fields = {"event": {"enum": EVENTS}, "city": {"type": "string", "maxLength": 40}, "month": {"enum": MONTHS},
              "day": {"type": "integer", "minimum": 1, "maximum": 31}}
    text = f"The {kind} takes place in {city} on {month} {day}."
    if i % 2:
        fields["guests"] = {"type": "integer", "minimum": 0}
        text += f" About {guests} guests are expected."
    if i % 3 == 2:
        fields["organiser"] = {"type": "string", "maxLength": 40}
        text += f" It is organised by {host}."
    return _extraction(f"event{i}", "event", text, fields)


def _extraction(name: str, what: str, text: str, fields: dict) -> Task:
    schema = {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}
    keys = ", ".join(fields)
    msg = f"Extract the {what} from this text as JSON with the keys {keys}.\n\nText: {text}"
    return Task(name, "extraction", [{"role": "user", "content": msg}], {"json_schema": schema}, schema=schema)


def tasks(n_extraction: int, n_classification: int, n_tools: int, seed: int = 0) -> list[Task]:
    r = random.Random(seed)
    out = [(_person, _order, _event)[i % 3](r, i) for i in range(n_extraction)]
    for i in range(n_classification):
        p = r.choice(PRODUCTS)
        if i % 2:
            label = r.choice(list(REVIEW))
            text, choices, q = r.choice(REVIEW[label]).format(p=p), list(REVIEW), "Is this review positive, negative or neutral?"
        else:
            label = r.choice(list(TICKET))
            text, choices, q = TICKET[label].format(p=p), list(TICKET), f"Which team handles this ticket ({', '.join(TICKET)})?"
        out.append(Task(f"classify{i}", "classification", [{"role": "user", "content": f"{text}\n\n{q}"}],
                        {"choice": choices}, choices=choices, max_tokens=8))
    for i in range(n_tools):
        if i % 2:
            msg = f"What will the weather be in {r.choice(CITIES)} over the next {r.randint(1, 7)} days?"
        else:
            msg = (f"Book a table at {r.choice(['Casa Nova', 'Blue Fig', 'Sakura', 'Le Petit Four'])} for "
                   f"{r.randint(2, 8)} people at {r.randint(12, 21)}:{r.choice(['00', '15', '30', '45'])}.")
        out.append(Task(f"tool{i}", "tools", [{"role": "user", "content": msg}],
                        toolcalls.plan(TOOLS, "required").constraint(), tools=TOOLS))
    return out


def valid(task: Task, text: str) -> bool:
    try:
        if task.workload == "extraction":
            jsonschema.validate(json.loads(text), task.schema)
            return True
        if task.workload == "classification":
            return text in task.choices
        content, calls = toolcalls.parse(text, toolcalls.plan(task.tools, "required"))
        if not calls:
            return False
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in task.tools}
        for c in calls:  # {"name", "arguments": JSON text}
            jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
        return True
    except (ValueError, jsonschema.ValidationError, KeyError, TypeError):
        return False


# --- ours -------------------------------------------------------------------------------------------

class ConstraintClock:
    """Seconds spent in the engine's constraint work (Engine._constrain: the masks at every verify
    position; Engine._forced: the forced tokens), per engine."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        for name in ("_constrain", "_forced"):
            original = getattr(Engine, name)

            def timed(engine, *a, _original=original, **kw):
                t = time.perf_counter()
                try:
                    return _original(engine, *a, **kw)
                finally:
                    self.seconds[id(engine)] = self.seconds.get(id(engine), 0.0) + time.perf_counter() - t
            setattr(Engine, name, timed)

    def take(self, engine: Engine) -> float:
        return self.seconds.pop(id(engine), 0.0)


@dataclass
class Result:
    task: str
    workload: str
    text: str
    token_ids: list[int]
    decode_tokens: int
    decode_s: float
    total_s: float
    steps: int
    forced: int
    constraint_s: float
    valid: bool
    extra: dict = field(default_factory=dict)


def prompt_ids(llm: LLM, task: Task, chat: bool) -> list[int]:
    if chat:
        return llm.encode_chat(task.messages, tools=task.tools)
    return llm.encode(task.messages[0]["content"] + "\nAnswer: ")


def run_ours(llm: LLM, clock: ConstraintClock, task: Task, chat: bool) -> Result:
    params = SamplingParams(temperature=0, max_tokens=task.max_tokens, constraint=task.constraint)
    ids = prompt_ids(llm, task, chat)
    clock.take(llm.engine)
    start = time.perf_counter()
    first = final = None
    for out in llm.stream(ids, params):
        if first is None:
            first = time.perf_counter()
        final = out
    end = time.perf_counter()
    s = final.stats
    n = len(final.token_ids)
    return Result(task.name, task.workload, final.text, list(final.token_ids), n - 1, end - first, end - start,
                  s.num_steps, s.num_forced_tokens, clock.take(llm.engine), valid(task, final.text),
                  {"finish_reason": final.finish_reason,
                   "drafts_not_forced": s.num_accepted_tokens - s.num_forced_tokens})


# --- llama.cpp --------------------------------------------------------------------------------------

class GrammarPeer(llamacpp.Peer):
    """llama-completion with --json-schema-file, stopping at the end of generation (no --ignore-eos:
    a finished grammar allows only the end)."""

    def __init__(self, llama, gguf: Path, schema_file: Path, n_threads: int):
        super().__init__(llama, "llama-completion", gguf, [*llamacpp.PLAIN_FLAGS, "-jf", str(schema_file)])

    def command(self, prompt, n, threads):
        return [c for c in super().command(prompt, n, threads) if c != "--ignore-eos"]


def run_peer(llama, gguf: Path, task: Task, prompt_text: str, ids: list[int], threads: int) -> Result:
    schema = task.constraint.get("json_schema") or {"enum": task.choices}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(schema, f)
    try:
        # room for its whitespace (its JSON grammar lets the model lay out as it likes: more tokens)
        run = GrammarPeer(llama, gguf, Path(f.name), threads).run(llamacpp.Prompt(prompt_text, ids),
                                                                  2 * task.max_tokens, threads)
    finally:
        os.unlink(f.name)
    text = run.text.strip().removesuffix("[end of text]").strip()
    if task.workload == "classification":  # the enum's JSON string
        try:
            text = json.loads(text)
        except ValueError:
            pass
    return Result(task.name, task.workload, text, [], run.decode_tokens, run.decode_s, run.prompt_s + run.decode_s,
                  run.decode_tokens, 0, 0.0, valid(task, text), {"prompt_s": run.prompt_s})


# --- the run ----------------------------------------------------------------------------------------

MODEL_METHODS = {  # method -> LLM keyword arguments
    "smollm2": {"plain": {"method": "none"}, "forced": {"method": "ngram", "spec_options": {"min_ngram": 64, "max_ngram": 64}},
                "suffix": {"method": "suffix"}, "ngram": {"method": "ngram"}},
    "bundled": {"plain": {"method": "none"}, "forced": {"method": "ngram", "spec_options": {"min_ngram": 64, "max_ngram": 64}},
                "suffix": {"method": "suffix"}, "ngram": {"method": "ngram"}, "draft": {"method": "draft"},
                "eagle3": {"method": "eagle3"}},
}
# "forced": the constraint's forced tokens on their own. Forced tokens need a speculating engine (k > 0), so
# the proposer is an n-gram lookup that cannot match (a 64-token tail never recurs in these prompts): the
# accepted drafts that were not forced are reported (drafts_not_forced), and are 0 when it is so.


def summarise(results: list[Result], plain: list[Result] | None) -> dict:
    tok = sum(r.decode_tokens for r in results)
    sec = sum(r.decode_s for r in results)
    out = {"requests": len(results), "decode_tokens": tok, "decode_s": round(sec, 3),
           "tokens_per_s": round(tok / sec, 2) if sec else None,
           "median_request_tokens_per_s": round(statistics.median(r.decode_tokens / r.decode_s for r in results
                                                                   if r.decode_s > 0), 2),
           "valid": sum(r.valid for r in results) / len(results),
           "forced_tokens_per_request": round(sum(r.forced for r in results) / len(results), 2),
           "tokens_per_step": round(sum(len(r.token_ids) for r in results) / max(1, sum(r.steps for r in results)), 3)
           if results[0].token_ids else None,
           "drafts_not_forced": sum(r.extra.get("drafts_not_forced", 0) for r in results),
           "finished_by_length": sum(r.extra.get("finish_reason") == "length" for r in results),
           "mean_request_s": round(sum(r.total_s for r in results) / len(results), 3),
           "constraint_share": round(sum(r.constraint_s for r in results) / sum(r.total_s for r in results), 4)}
    if plain is not None:
        if results[0].token_ids:
            out["identical_to_plain"] = sum(a.token_ids == b.token_ids for a, b in zip(results, plain))
        else:
            out["identical_text_to_plain"] = sum(a.text.strip() == b.text.strip() for a, b in zip(results, plain))
        ptok, psec = sum(r.decode_tokens for r in plain), sum(r.decode_s for r in plain)
        out["speedup_vs_plain"] = round((tok / sec) / (ptok / psec), 3) if sec and psec else None
        out["request_speedup_vs_plain"] = round(sum(r.total_s for r in plain) / sum(r.total_s for r in results), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2", help="comma-separated: smollm2, bundled")
    ap.add_argument("--extraction", type=int, default=60)
    ap.add_argument("--classification", type=int, default=20)
    ap.add_argument("--tools", type=int, default=12)
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens (policy fixed)")
    ap.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads (1: a shared machine oversubscribed by 2 threads stalls)")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the model's methods")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()
    steady_steps()  # no background AOT build competing with the timings
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    clock = ConstraintClock()
    all_tasks = tasks(args.extraction, args.classification, args.tools)
    report = {"command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
              "commit": git_commit(Path(__file__).parent),
              "machine": {"cpu": cpu_model(), "threads": args.threads, "load_before": os.getloadavg(),
                          "torch": torch.__version__, "python": platform.python_version()},
              "k": args.k, "tasks": {w: sum(t.workload == w for t in all_tasks)
                                      for w in ("extraction", "classification", "tools")}, "models": {}}
    for model in args.models.split(","):
        models = llamacpp.model_set(model)
        methods = MODEL_METHODS[model]
        if args.methods:
            methods = {m: methods[m] for m in args.methods.split(",") if m in methods}
        llms = {}
        for m, kw in methods.items():
            extra = {} if kw["method"] == "none" else {"num_speculative_tokens": args.k, "policy": "fixed"}
            if kw["method"] == "draft":
                extra["draft"] = str(models.draft)
            if kw["method"] == "eagle3":
                extra["draft"] = str(models.head)
            llms[m] = LLM(str(models.target), dtype="float32", **kw, **extra)
        chat = models.chat
        results: dict[str, list[Result]] = {m: [] for m in llms}
        warm = all_tasks[0]
        for llm in llms.values():
            run_ours(llm, clock, warm, chat)
        for i, task in enumerate(all_tasks):
            order = list(llms) if i % 2 == 0 else list(llms)[::-1]  # ABBA: interleaved, the order alternating
            for m in order:
                results[m].append(run_ours(llms[m], clock, task, chat))
            print(f"{model} {task.name}: " + " ".join(
                f"{m} {results[m][-1].decode_tokens / max(1e-9, results[m][-1].decode_s):.0f} tok/s "
                f"{'valid' if results[m][-1].valid else 'INVALID'}" for m in llms), flush=True)
        peer, peer_skipped = [], None
        if not args.no_llamacpp:
            llama = llamacpp.ensure_llama_cpp()
            try:
                gguf = models.gguf(llama, "F32")
            except QuickdraftError as exc:  # e.g. llama.cpp's converter cannot read the checkpoint's quantisation
                peer_skipped = f"no F32 GGUF: {str(exc).splitlines()[0][:200]} ... {str(exc).strip().splitlines()[-1][:200]}"
                print(f"llama.cpp skipped: {peer_skipped}", flush=True)
        if not args.no_llamacpp and peer_skipped is None:
            first = next(iter(llms.values()))
            tok = first.tokenizer
            for task in all_tasks:
                if task.workload == "tools":
                    continue  # llama.cpp's completion has no tool calling; its grammar is the schema's
                ids = prompt_ids(first, task, chat)
                text = tok.decode(ids, skip_special_tokens=False) if chat else task.messages[0]["content"] + "\nAnswer: "
                peer.append(run_peer(llama, gguf, task, text, ids, args.threads))
        plain = results.get("plain")  # None: a run of other methods alone (validity over many tasks)
        entry = {"target": str(models.target), "chat_template": chat, "workloads": {}}
        if peer_skipped:
            entry["llama.cpp_skipped"] = peer_skipped
        for w in ("extraction", "classification", "tools", "all"):
            pick = (lambda rs: rs) if w == "all" else (lambda rs, w=w: [r for r in rs if r.workload == w])
            entry["workloads"][w] = {m: summarise(pick(rs), pick(plain) if m != "plain" and plain else None)
                                     for m, rs in results.items() if pick(rs)}
            if peer and w in ("extraction", "classification"):
                pr = pick(peer)
                s = summarise(pr, pick(plain) if plain else None)
                entry["workloads"][w]["llama.cpp"] = s
        entry["outputs"] = {m: [{"task": r.task, "text": r.text, "valid": r.valid, "forced": r.forced,
                                 "tokens": r.decode_tokens + 1, "decode_s": round(r.decode_s, 4)} for r in rs]
                            for m, rs in {**results, **({"llama.cpp": peer} if peer else {})}.items()}
        report["models"][model] = entry
        del llms
    report["machine"]["load_after"] = os.getloadavg()
    report["provenance"] = provenance(threads=args.threads, load_before=load_before)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# Structured output: plain vs speculative constrained decoding, and llama.cpp", "",
             f"Command: `{report['command']}`; commit {report['commit']}; {m['cpu']}, {m['threads']} threads; "
             f"load average before {m['load_before'][0]:.2f}, after {m['load_after'][0]:.2f}; k = {report['k']} "
             "(policy fixed); greedy. Tasks: " + ", ".join(f"{n} {w}" for w, n in report["tasks"].items()) + ".", ""]
    for model, entry in report["models"].items():
        lines += [f"## {model}", "", "| workload | method | tok/s | speedup vs plain | tokens/step | forced/request "
                  "| valid | identical to plain | constraint share of run | s/request | request speedup |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for w, rows in entry["workloads"].items():
            for meth, s in rows.items():
                ident = s.get("identical_to_plain", s.get("identical_text_to_plain"))
                ident = "-" if ident is None else f"{ident}/{s['requests']}" + (" (text)" if "identical_text_to_plain" in s else "")
                lines.append(f"| {w} | {meth} | {s['tokens_per_s']} | {s.get('speedup_vs_plain', '-')} | "
                             f"{s['tokens_per_step'] or '-'} | {s['forced_tokens_per_request']} | {s['valid']:.0%} | "
                             f"{ident} | {s['constraint_share']:.1%} | {s['mean_request_s']} | "
                             f"{s.get('request_speedup_vs_plain', '-')} |")
        if entry.get("llama.cpp_skipped"):
            lines.append(f"llama.cpp: not run ({entry['llama.cpp_skipped']}).")
        lines.append("")
    lines.append(provenance_line(report["provenance"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
