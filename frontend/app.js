// Tandem's chat UI: streams answers from /v1/chat/completions over Server-Sent Events.
// Model output is only ever set through textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model-name"),
  conversation: $("conversation"),
  empty: $("empty"),
  composer: $("composer"),
  input: $("input"),
  send: $("send"),
  stop: $("stop"),
  newChat: $("new-chat"),
  toggleSettings: $("toggle-settings"),
  settings: $("settings"),
  systemPrompt: $("system-prompt"),
  temperature: $("temperature"),
  temperatureValue: $("temperature-value"),
  maxTokens: $("max-tokens"),
  apiKey: $("api-key"),
  template: $("message-template"),
};

const SETTINGS_KEY = "tandem.settings";
let modelName = null;
let history = []; // [{role, content}] of the finished turns
let controller = null; // AbortController of the answer in progress

// ---- settings -------------------------------------------------------------

function loadSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
    if (typeof saved.systemPrompt === "string") ui.systemPrompt.value = saved.systemPrompt;
    if (typeof saved.temperature === "number") ui.temperature.value = saved.temperature;
    if (typeof saved.maxTokens === "string") ui.maxTokens.value = saved.maxTokens;
    if (typeof saved.apiKey === "string") ui.apiKey.value = saved.apiKey;
  } catch {
    localStorage.removeItem(SETTINGS_KEY);
  }
  showTemperature();
}

function saveSettings() {
  localStorage.setItem(
    SETTINGS_KEY,
    JSON.stringify({
      systemPrompt: ui.systemPrompt.value,
      temperature: Number(ui.temperature.value),
      maxTokens: ui.maxTokens.value,
      apiKey: ui.apiKey.value,
    }),
  );
}

// The headers of every API call: the key, when the server wants one (--api-key).
function apiHeaders(extra = {}) {
  const key = ui.apiKey.value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function showTemperature() {
  ui.temperatureValue.textContent = Number(ui.temperature.value).toFixed(2);
}

// ---- model ----------------------------------------------------------------

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders() });
    if (response.status === 401) {
      ui.model.textContent = "API key needed: see Settings";
      ui.model.classList.add("offline");
      return;
    }
    const body = await response.json();
    const card = body.data[0];
    modelName = card.id;
    ui.model.textContent = `${card.id} · ${card.max_model_len} tokens of context`;
    ui.model.classList.remove("offline");
  } catch {
    ui.model.textContent = "server unreachable";
    ui.model.classList.add("offline");
  }
}

// ---- conversation view ----------------------------------------------------

function addMessage(role, text) {
  ui.empty.hidden = true;
  const node = ui.template.content.firstElementChild.cloneNode(true);
  node.classList.add(role);
  node.querySelector(".role").textContent = role;
  node.querySelector(".content").textContent = text;
  ui.conversation.append(node);
  scrollToEnd(true);
  return node;
}

function nearEnd() {
  const c = ui.conversation;
  return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
}

function scrollToEnd(force) {
  if (force || nearEnd()) ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

// While an answer streams, the next message can be typed but not sent.
function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  if (!busy) ui.input.focus();
}

function resizeInput() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${ui.input.scrollHeight}px`;
}

// ---- streaming ------------------------------------------------------------

// Yields the parsed JSON of each `data:` event of an SSE response, until [DONE].
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function requestBody(messages) {
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(ui.temperature.value),
  };
  if (modelName) body.model = modelName;
  const maxTokens = parseInt(ui.maxTokens.value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

async function send(text) {
  // "New chat" may replace `history` while this answer streams; keep to this one.
  const turns = history;
  turns.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const node = addMessage("assistant", "");
  node.classList.add("pending");
  const content = node.querySelector(".content");
  const meta = node.querySelector(".meta");

  const system = ui.systemPrompt.value.trim();
  const messages = system ? [{ role: "system", content: system }, ...turns] : [...turns];
  controller = new AbortController();
  setBusy(true);

  const started = performance.now();
  let firstToken = null;
  let answer = "";
  let usage = null;
  let finishReason = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: apiHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(requestBody(messages)),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      if (choice.finish_reason) finishReason = choice.finish_reason;
      const piece = choice.delta?.content;
      if (piece) {
        if (firstToken === null) firstToken = performance.now();
        answer += piece;
        content.textContent = answer;
        scrollToEnd(false);
      }
    }
    meta.textContent = describe(started, firstToken, performance.now(), usage, finishReason);
  } catch (error) {
    if (error.name === "AbortError") {
      meta.textContent = `stopped after ${((performance.now() - started) / 1000).toFixed(1)} s`;
    } else {
      meta.textContent = error.message;
      meta.classList.add("error");
    }
  } finally {
    node.classList.remove("pending");
    controller = null;
    setBusy(false);
  }
  // A partial answer stays in the conversation, so the next turn can build on it.
  // Without one, the question leaves it too (roles must alternate for most templates).
  if (answer) {
    turns.push({ role: "assistant", content: answer });
  } else {
    turns.pop();
    question.classList.add("unsent");
    question.querySelector(".meta").textContent = "not sent: edit and send again";
    if (turns === history && !ui.input.value) ui.input.value = text;
  }
}

function describe(started, firstToken, ended, usage, finishReason) {
  const parts = [];
  if (usage) {
    parts.push(`${usage.completion_tokens} tokens`);
    // Decode speed: the tokens after the first, over the time after the first.
    const seconds = firstToken === null ? 0 : (ended - firstToken) / 1000;
    if (usage.completion_tokens > 1 && seconds > 0) {
      parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tokens/s`);
    }
  }
  if (firstToken !== null) parts.push(`first token ${((firstToken - started) / 1000).toFixed(2)} s`);
  if (finishReason === "length") parts.push("cut at the token limit");
  return parts.join(" · ");
}

// ---- events ---------------------------------------------------------------

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.input.value.trim();
  if (!text || controller) return;
  ui.input.value = "";
  resizeInput();
  send(text);
});

ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});

ui.input.addEventListener("input", resizeInput);

// Aborting the fetch closes the connection, and the server aborts the request.
ui.stop.addEventListener("click", () => controller?.abort());

ui.newChat.addEventListener("click", () => {
  controller?.abort();
  history = [];
  ui.conversation.querySelectorAll(".message").forEach((node) => node.remove());
  ui.empty.hidden = false;
  ui.input.focus();
});

ui.toggleSettings.addEventListener("click", () => {
  ui.settings.hidden = !ui.settings.hidden;
  ui.toggleSettings.setAttribute("aria-expanded", String(!ui.settings.hidden));
});

ui.temperature.addEventListener("input", showTemperature);
for (const field of [ui.systemPrompt, ui.temperature, ui.maxTokens, ui.apiKey]) {
  field.addEventListener("change", saveSettings);
}
ui.apiKey.addEventListener("change", loadModel);

loadSettings();
loadModel();
ui.input.focus();
