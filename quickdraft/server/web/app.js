// quickdraft's chat page. Plain JavaScript, no dependencies, served by the server it talks to:
// every request goes to this origin (relative URLs only). The conversation and settings stay in
// localStorage; an API key only in sessionStorage, sent as the Authorization header, never in a URL.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "quickdraft.conversation";
const SETTINGS = "quickdraft.settings";
const KEY = "quickdraft.apiKey";
const ORIGINS = ["draft", "target", "prefill", "forced"]; // the ones the legend knows; others show grey
const FIELDS = ["mode", "system", "temperature", "max_tokens", "k"];

let conversation = load(STORE, []); // [{role, content, tokens?: [[text, origin, id]], stats?, error?, k?}]
let modelName = null;
let controller = null; // the running request's AbortController
let noChatTemplate = false; // auto mode found that the model has no chat template

function load(name, fallback) {
  try { return JSON.parse(localStorage.getItem(name)) ?? fallback; } catch (e) { return fallback; }
}
function save() {
  localStorage.setItem(STORE, JSON.stringify(conversation));
  const s = {};
  for (const f of FIELDS) s[f] = $(f).value;
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}
function apiKey() { return sessionStorage.getItem(KEY) || ""; }

// ---- API calls ---------------------------------------------------------------------------

class HTTPError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status;
    this.param = body && body.error ? body.error.param : null;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

async function call(path, options = {}) {
  // fetch a /v1 path; a 401 asks for the key and tries again
  for (;;) {
    const r = await fetch(path, { ...options, headers: headers() });
    if (r.status === 401) {
      const body = await r.json().catch(() => null);
      await askKey(apiKey() ? (body && body.error ? body.error.message : "invalid API key") : "");
      continue;
    }
    if (!r.ok) throw new HTTPError(r.status, await r.json().catch(() => null));
    return r;
  }
}

function askKey(error) {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-error").textContent = error;
    $("key").value = "";
    dialog.onclose = () => {
      sessionStorage.setItem(KEY, $("key").value.trim());
      resolve();
    };
    if (!dialog.open) dialog.showModal();
  });
}

async function loadModel() {
  try {
    const r = await call("v1/models");
    const data = (await r.json()).data;
    modelName = data[0].id;
    $("model").textContent = modelName + (data[0].max_model_len ? ` · context ${data[0].max_model_len}` : "");
    $("status").textContent = "";
  } catch (e) {
    $("status").textContent = "server: " + e.message;
  }
}

// ---- server-sent events ------------------------------------------------------------------

async function* events(response) {
  // the JSON payloads of an SSE body, until [DONE]
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// ---- one answer --------------------------------------------------------------------------

function requestBody(history, k) {
  const s = {
    model: modelName, stream: true, stream_options: { include_usage: true },
    return_token_origins: true, return_token_ids: true,
    temperature: Number($("temperature").value || 0),
    max_tokens: Number($("max_tokens").value || 128),
  };
  const kk = k !== undefined ? k : $("k").value;
  if (kk !== "" && kk !== null) s.num_speculative_tokens = Number(kk);
  const system = $("system").value;
  if (mode() === "chat") {
    const messages = system ? [{ role: "system", content: system }] : [];
    for (const m of history) if (!m.error) messages.push({ role: m.role, content: m.content });
    return { path: "v1/chat/completions", body: { ...s, messages } };
  }
  // completion: the model continues the last message (after the system prompt, if any)
  const last = history[history.length - 1];
  return { path: "v1/completions", body: { ...s, prompt: (system ? system + "\n" : "") + last.content } };
}

function mode() {
  const m = $("mode").value;
  return m === "auto" ? (noChatTemplate ? "completion" : "chat") : m;
}

async function answer(history, k, compared) {
  // stream one answer to `history` (ending with the user's message) into a new message;
  // `compared`: the tokens/s of the answer this one repeats without speculation
  const msg = { role: "assistant", content: "", tokens: [], stats: null, k: k, compared: compared };
  conversation.push(msg);
  const view = render(msg);
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null, last = null;
  try {
    let r;
    for (;;) {
      const { path, body } = requestBody(history, k);
      msg.mode = mode();
      try {
        r = await call(path, { method: "POST", body: JSON.stringify(body), signal: controller.signal });
        break;
      } catch (e) {
        // auto mode on a model without a chat template (the bundled code pair): complete instead
        if (e.status === 400 && e.param === "messages" && /chat template/.test(e.message) && $("mode").value === "auto"
            && !noChatTemplate) {
          noChatTemplate = true;
          $("status").textContent = "no chat template on this model: the page asks for completions of your text";
          continue;
        }
        throw e;
      }
    }
    for await (const ev of events(r)) {
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) msg.usage = ev.usage;
      for (const choice of ev.choices || []) {
        const now = performance.now();
        const texts = choice.token_texts || [];
        (choice.token_origins || []).forEach((o, i) => {
          msg.tokens.push([texts[i] ?? "", o, choice.token_ids ? choice.token_ids[i] : null]);
          if (first === null) first = now;
          last = now;
        });
        msg.content += choice.delta ? (choice.delta.content || "") : (choice.text || "");
        if (choice.finish_reason) msg.finish = choice.finish_reason;
      }
      view.update();
    }
  } catch (e) {
    if (e.name === "AbortError") msg.finish = "stopped";
    else msg.error = e.message;
  } finally {
    controller = null;
    setBusy(false);
  }
  msg.stats = figures(msg, started, first, last);
  view.update();
  save();
}

function figures(msg, started, first, last) {
  // the per-answer figures: timing measured here; speculation from the server's usage
  const counts = {};
  for (const [, o] of msg.tokens) counts[o] = (counts[o] || 0) + 1;
  const n = msg.tokens.length;
  const stats = { tokens: n, counts, ttft_s: first === null ? null : (first - started) / 1000 };
  if (n > 1 && last > first) stats.tokens_per_s = (n - 1) / ((last - first) / 1000);
  if (msg.usage) {
    const sp = msg.usage.speculation || {};
    Object.assign(stats, {
      completion_tokens: msg.usage.completion_tokens, method: sp.method, num_drafts: sp.num_drafts,
      draft_tokens: sp.draft_tokens, accepted_tokens: sp.accepted_tokens, acceptance_rate: sp.acceptance_rate,
      mean_acceptance_length: sp.mean_acceptance_length, accepted_per_position: sp.accepted_per_position || [],
      num_steps: sp.num_steps,
    });
  }
  return stats;
}

// ---- rendering ---------------------------------------------------------------------------

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function originClass(o) { return "tok o-" + (ORIGINS.includes(o) ? o : "other"); }

function render(msg) {
  const box = el("div", "msg " + msg.role);
  const role = el("div", "role");
  box.append(role);
  const body = el("div", "body");
  box.append(body);
  const footer = el("div");
  box.append(footer);
  $("messages").append(box);
  let shown = 0; // tokens already in the body
  const update = () => {
    role.textContent = msg.role === "user" ? "you" : ["model", msg.mode === "completion" ? "completion" : null,
      msg.k !== undefined && msg.k !== null ? `k = ${msg.k}` : null].filter(Boolean).join(" · ");
    if (msg.role === "user" || !msg.tokens) {
      body.textContent = msg.content;
    } else {
      for (; shown < msg.tokens.length; shown++) {
        const [text, origin, id] = msg.tokens[shown];
        const span = el("span", originClass(origin), text);
        span.dataset.origin = origin;
        span.title = origin + (id !== null && id !== undefined ? ` · token ${id}` : "");
        body.append(span);
      }
      if (msg.stats) trim(body, msg.content);
    }
    footer.replaceChildren();
    if (msg.error) footer.append(el("div", "error", msg.error));
    if (msg.stats) footer.append(statsView(msg), actions(msg));
    box.scrollIntoView({ block: "end" });
  };
  update();
  return { update };
}

function trim(body, content) {
  // a stop string ends the text inside a token: show only the answer's text (every token's span stays)
  let at = 0;
  for (const span of body.children) {
    const t = span.textContent;
    if (at + t.length > content.length) span.textContent = t.slice(0, Math.max(0, content.length - at));
    at += t.length;
  }
}

function fmt(x, digits = 2) { return x === null || x === undefined || Number.isNaN(x) ? "–" : x.toFixed(digits); }

function statsView(msg) {
  const s = msg.stats;
  const box = el("div", "stats");
  const item = (label, value, key) => {
    const e = el("span");
    e.append(label + " ", el("b", "", value));
    if (key) e.dataset.key = key;
    box.append(e);
  };
  item("tokens", String(s.tokens), "tokens");
  item("tokens/s", fmt(s.tokens_per_s, 1), "tokens_per_s");
  item("first token", s.ttft_s === null ? "–" : fmt(s.ttft_s, 2) + " s", "ttft");
  if (s.accepted_per_position) {
    item("mean acceptance length", s.num_drafts ? fmt(s.mean_acceptance_length) : "–", "mean_acceptance_length");
    item("acceptance rate", s.draft_tokens ? fmt(100 * s.acceptance_rate, 1) + "%" : "–", "acceptance_rate");
    item("accepted", `${s.accepted_tokens}/${s.draft_tokens}`, "accepted");
  }
  for (const o of Object.keys(s.counts)) item(o, String(s.counts[o]), "origin-" + o);
  if (msg.finish) item("finish", msg.finish, "finish");
  if (msg.compared && s.tokens_per_s) {
    item("speculation's speedup", fmt(msg.compared / s.tokens_per_s) + "×", "speedup");
  }
  if (s.accepted_per_position && s.num_drafts) {
    const chart = el("span", "chart");
    chart.title = "acceptance by draft position: accepted at position i / drafting steps";
    chart.append(barChart(s.accepted_per_position.map((a) => a / s.num_drafts), 140, 46));
    box.append(chart);
  }
  // the figures as the server sent them, for scripts and tests
  box.dataset.figures = JSON.stringify(s);
  return box;
}

function actions(msg) {
  const box = el("div", "actions");
  if (msg.k === 0) return box;
  const b = el("button", "", "Again without speculation (k = 0)");
  b.type = "button";
  b.title = "the same request with num_speculative_tokens 0: plain decoding's speed beside this one";
  b.onclick = () => {
    const i = conversation.indexOf(msg);
    if (controller || i < 1) return;
    answer(conversation.slice(0, i).filter((m) => m.role === "user" || !m.error), 0, msg.stats.tokens_per_s);
  };
  box.append(b);
  return box;
}

const SVG = "http://www.w3.org/2000/svg"; // the SVG namespace name (an identifier: nothing is fetched)

function barChart(values, width, height) {
  // bars for values in [0, 1], one per draft position, with the position under each
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("role", "img");
  const n = Math.max(values.length, 1), plot = height - 12, w = width / n;
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
  add("line", { x1: 0, y1: plot + 0.5, x2: width, y2: plot + 0.5, class: "axis" });
  values.forEach((v, i) => {
    const h = Math.max(0, Math.min(1, v)) * (plot - 2);
    const bar = add("rect", { x: i * w + 2, y: plot - h, width: Math.max(1, w - 4), height: h, class: "bar" });
    const title = document.createElementNS(SVG, "title");
    title.textContent = `position ${i + 1}: ${(100 * v).toFixed(0)}%`;
    bar.append(title);
    add("text", { x: i * w + w / 2, y: height - 1, "text-anchor": "middle" }, String(i + 1));
  });
  return svg;
}

function renderAll() {
  $("messages").replaceChildren();
  for (const m of conversation) render(m);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// ---- the server panel (GET /metrics, open without a key) ---------------------------------

function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const label = m[2] ? m[2].slice(1, -1) : "";
    (out[m[1]] = out[m[1]] || {})[label] = Number(m[3]);
  }
  return out;
}

let previous = null;

async function pollMetrics() {
  try {
    const r = await fetch("metrics");
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const m = parseMetrics(await r.text());
    const one = (name) => (m[name] ? m[name][""] : undefined);
    $("s-running").textContent = one("num_requests_running") ?? "–";
    $("s-waiting").textContent = one("num_requests_waiting") ?? "–";
    $("s-tokens").textContent = one("generation_tokens_total") ?? "–";
    const steps = one("engine_step_seconds_count"), sum = one("engine_step_seconds_sum");
    if (previous && steps > previous.steps) {
      $("s-step").textContent = fmt(1000 * (sum - previous.sum) / (steps - previous.steps), 1) + " ms";
    } else if (!previous && steps) {
      $("s-step").textContent = fmt(1000 * sum / steps, 1) + " ms";
    }
    previous = { steps, sum };
    const drafts = one("spec_decode_num_drafts_total"), drafted = one("spec_decode_num_draft_tokens_total");
    const accepted = one("spec_decode_num_accepted_tokens_total");
    $("s-rate").textContent = drafted ? fmt(100 * accepted / drafted, 1) + "%" : "–";
    $("s-mal").textContent = drafts ? fmt(1 + accepted / drafts) : "–";
    const perPos = m["spec_decode_num_accepted_tokens_per_pos_total"] || {};
    const values = [];
    for (const [label, v] of Object.entries(perPos)) {
      const p = Number((label.match(/position="(\d+)"/) || [])[1]);
      if (!Number.isNaN(p)) values[p] = drafts ? v / drafts : 0;
    }
    $("s-chart").replaceChildren(barChart(Array.from(values, (v) => v || 0), 280, 70));
    $("server-state").textContent = "";
  } catch (e) {
    $("server-state").textContent = "(metrics: " + e.message + ")";
  }
}

function showMethod() {
  // the server's speculation method, as the latest answer's usage named it
  const last = [...conversation].reverse().find((m) => m.stats && m.stats.method);
  if (last) $("s-method").textContent = last.stats.method;
}

// ---- wiring ------------------------------------------------------------------------------

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  if (!modelName) await loadModel();
  if (!modelName) return;
  $("prompt").value = "";
  const msg = { role: "user", content: text };
  conversation.push(msg);
  render(msg);
  save();
  await answer(conversation.filter((m) => m.role === "user" || !m.error).slice());
  showMethod();
}

function init() {
  const s = load(SETTINGS, {});
  for (const f of FIELDS) if (s[f] !== undefined) $(f).value = s[f];
  for (const f of FIELDS) $(f).addEventListener("change", save);
  $("mode").addEventListener("change", () => { noChatTemplate = false; });
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation = [];
    save();
    renderAll();
  });
  renderAll();
  showMethod();
  loadModel();
  pollMetrics();
  setInterval(pollMetrics, 2000);
}

init();
