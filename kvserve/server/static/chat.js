// kvserve playground: streams /v1/chat/completions and shows, per reply, TTFT, tokens/s, cached
// prompt tokens and the system_fingerprint. No dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // [{role, content}] of the conversation so far
let controller = null;

const JSON_BODY = { "Content-Type": "application/json" };  // the key: auth.js adds it

async function loadModels() {
  try {
    const resp = await kvAuth.fetch("/v1/models");
    const body = await resp.json();
    if (!resp.ok) throw new Error(body.error ? body.error.message : resp.status);
    const select = $("model");
    select.innerHTML = "";
    for (const m of body.data) {
      const opt = document.createElement("option");
      opt.value = m.id;
      opt.textContent = `${m.id} (context ${m.max_model_len})`;
      select.appendChild(opt);
    }
    $("server-status").textContent = "ready";
  } catch (err) {
    $("server-status").textContent = "not ready: " + err.message;
    setTimeout(loadModels, 2000);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function numberOr(id, fallback) {
  const v = $(id).value.trim();
  return v === "" ? fallback : Number(v);
}

function constraintFields() {
  const kind = $("constraint_kind").value;
  const text = $("constraint").value.trim();
  if (!kind) return {};
  if (kind === "json_object") return { response_format: { type: "json_object" } };
  if (kind === "json_schema") {
    return { response_format: { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(text) } } };
  }
  if (kind === "regex") return { structured_outputs: { regex: text } };
  if (kind === "choice") return { structured_outputs: { choice: JSON.parse(text) } };
  return {};
}

function buildBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true },
    max_tokens: numberOr("max_tokens", 64),
    temperature: numberOr("temperature", 0),
    top_p: numberOr("top_p", 1),
    top_k: numberOr("top_k", 0),
    repetition_penalty: numberOr("rep_penalty", 1),
  };
  const seed = numberOr("seed", null);
  if (seed !== null) body.seed = seed;
  const stops = $("stop_text").value.split("\n").filter((s) => s.length);
  if (stops.length) body.stop = stops;
  return Object.assign(body, constraintFields());
}

function formatStats(s) {
  const parts = [];
  if (s.ttft_ms !== null) parts.push(`TTFT ${s.ttft_ms.toFixed(0)} ms`);
  if (s.tok_s !== null) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
  parts.push(`${s.completion_tokens} tokens`);
  parts.push(`prompt ${s.prompt_tokens} (cached ${s.cached_tokens})`);
  if (s.finish_reason) parts.push(`finish ${s.finish_reason}`);
  if (s.spec_proposed) parts.push(`spec accepted ${s.spec_accepted}/${s.spec_proposed}`);
  if (s.fingerprint) parts.push(s.fingerprint);
  return parts.join(" · ");
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  $("prompt").value = "";
  const bubble = addMessage("assistant", "");
  bubble.dataset.state = "streaming";
  const textSpan = bubble.querySelector(".text");
  const statsSpan = document.createElement("span");
  statsSpan.className = "stats";
  bubble.appendChild(statsSpan);
  const stats = { ttft_ms: null, tok_s: null, completion_tokens: 0, prompt_tokens: 0, cached_tokens: 0,
                  finish_reason: null, fingerprint: null, spec_proposed: 0, spec_accepted: 0 };
  let body;
  try {
    body = buildBody();
  } catch (err) {
    bubble.className = "msg error";
    textSpan.textContent = "constraint is not valid JSON: " + err.message;
    history.pop();
    return;
  }
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const t0 = performance.now();
  let tFirst = null, tLast = null, reply = "";
  try {
    const resp = await kvAuth.fetch("/v1/chat/completions", { method: "POST", headers: JSON_BODY, body: JSON.stringify(body), signal: controller.signal });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error(`HTTP ${resp.status}: ${err.error ? err.error.message : resp.statusText}`);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const now = performance.now();
          if (chunk.system_fingerprint) stats.fingerprint = chunk.system_fingerprint;
          if (chunk.usage) {
            stats.completion_tokens = chunk.usage.completion_tokens;
            stats.prompt_tokens = chunk.usage.prompt_tokens;
            const details = chunk.usage.prompt_tokens_details;
            if (details) stats.cached_tokens = details.cached_tokens;
          }
          if (chunk.metrics) {
            stats.spec_proposed = chunk.metrics.num_spec_proposed || 0;
            stats.spec_accepted = chunk.metrics.num_spec_accepted || 0;
          }
          for (const choice of chunk.choices || []) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              if (tFirst === null) { tFirst = now; stats.ttft_ms = now - t0; }
              tLast = now;
              reply += piece;
              textSpan.textContent = reply;
            }
            if (choice.finish_reason) stats.finish_reason = choice.finish_reason;
          }
          if (tFirst !== null && tLast > tFirst && stats.completion_tokens > 1) {
            stats.tok_s = (stats.completion_tokens - 1) / ((tLast - tFirst) / 1000);
          }
          statsSpan.textContent = formatStats(stats);
          $("messages").scrollTop = $("messages").scrollHeight;
        }
      }
    }
    history.push({ role: "assistant", content: reply });
    if (stats.fingerprint) $("fingerprint").textContent = "system_fingerprint " + stats.fingerprint;
    bubble.dataset.state = "done";
  } catch (err) {
    if (err.name === "AbortError") {
      stats.finish_reason = "stopped";
      history.push({ role: "assistant", content: reply });
      bubble.dataset.state = "done";
    } else {
      bubble.className = "msg error";
      textSpan.textContent = (reply ? reply + "\n" : "") + err.message;
      bubble.dataset.state = "error";
      history.pop();
    }
  } finally {
    statsSpan.textContent = formatStats(stats);
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { history.length = 0; $("messages").innerHTML = ""; });
$("constraint_kind").addEventListener("change", () => {
  const examples = {
    json_schema: '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}, "required": ["name", "age"]}',
    regex: "[0-9]{4}-[0-9]{2}-[0-9]{2}",
    choice: '["yes", "no", "maybe"]',
  };
  const kind = $("constraint_kind").value;
  if (examples[kind] && !$("constraint").value.trim()) $("constraint").value = examples[kind];
});
loadModels();
