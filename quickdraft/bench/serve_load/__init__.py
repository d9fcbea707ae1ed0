"""A load generator for a running OpenAI-compatible server.

Requests go to POST /v1/completions with `stream: true` and `stream_options.include_usage`,
either as a Poisson process at a request rate (exponential gaps from a seeded RNG; `inf`
sends all at once) or from a fixed number of clients sending back to back. Prompts are the
built-in held-out workloads of `quickdraft bench` or a JSONL file of {"prompt": ...}.

Per request: time to first token (TTFT: arrival of the first chunk with non-empty text),
end-to-end latency (E2E: until `data: [DONE]`), time per output token
(TPOT = (E2E - TTFT) / (n - 1)), and inter-token latencies (ITL). Speculative decoding
sends several tokens in one chunk, so one chunk's gap is split evenly over its tokens: a
chunk of 3 tokens 30 ms after the previous one gives three ITLs of 10 ms (the sum of the
ITLs is then the time from the first chunk to the last, and TPOT and mean ITL agree).
Tokens in the first chunk arrive within TTFT and have no ITL. Tokens per chunk are read
from the chunk when the server sends them (`token_ids` in the choice, which vLLM sends
for the extra field `return_token_ids: true`; requested unless --no-return-token-ids, and
ignored by servers that do not know it); otherwise the request's `usage.completion_tokens`
is apportioned over the chunks by their text length (each chunk with text gets at least
one token), an estimate that the results name (`token_source`). Output token counts
always come from `usage` when the server sends it.

Aggregates per run: mean, median and p99 of TTFT, TPOT, ITL and E2E; request and output
token throughput over the run's wall time; goodput, the requests per second that met every
SLO given (--slo-ttft-ms, --slo-tpot-ms). /metrics is scraped before and after each run:
acceptance rate = accepted / drafted tokens and mean acceptance length = 1 + accepted /
drafts (per drafting step, as vLLM reports it) over the run.

`chat` is the multi-turn chat workload (`--workload chat`: conversations sharing a system prompt,
each turn resending the history; TTFT per turn and the prefix hit rate; httpx or the openai client).

The pure statistics are in `stats`, the client in `client`; `quickdraft bench-serve`
(quickdraft.cli.bench_serve) is the command over them.
"""
