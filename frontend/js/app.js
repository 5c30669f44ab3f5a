// Tandem's web chat: conversations (store.js) shown as messages, answers streamed from
// /v1/chat/completions (api.js) and rendered as sanitized markdown (markdown.js), settings
// (settings.js) and the live engine panel (engine_panel.js). No build step: ES modules
// served as they are.

import { fetchModel, streamChat } from "./api.js";
import { EnginePanel } from "./engine_panel.js";
import { StreamingMarkdown, renderMarkdown } from "./markdown.js";
import { Settings } from "./settings.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model-name"),
  conversation: $("conversation"),
  empty: $("empty"),
  composer: $("composer"),
  input: $("input"),
  send: $("send"),
  stop: $("stop"),
  sidebar: $("sidebar"),
  toggleSidebar: $("toggle-sidebar"),
  newChat: $("new-chat"),
  search: $("search"),
  list: $("conversation-list"),
  exportButton: $("export"),
  importButton: $("import"),
  importFile: $("import-file"),
  importStatus: $("import-status"),
  toggleTheme: $("toggle-theme"),
  template: $("message-template"),
};

const NARROW = window.matchMedia("(max-width: 799px)");
const PREFERS_DARK = window.matchMedia("(prefers-color-scheme: dark)");
const SAVE_EVERY_MS = 1000; // while an answer streams, it is saved this often

let modelName = null;
let conversation = null; // the one shown
let generation = null; // {controller, conversationId} of the answer streaming now

const settings = new Settings((name) => {
  if (name === "apiKey") loadModel();
  if (name === "theme") applyTheme();
});

// ---- model and theme --------------------------------------------------------

async function loadModel() {
  try {
    const card = await fetchModel(settings.apiKey);
    modelName = card.id;
    ui.model.textContent = `${card.id} · ${card.max_model_len} tokens of context`;
    ui.model.classList.remove("offline");
    settings.setModelDefaults(card.sampling_defaults);
  } catch (error) {
    const unauthorized = /api key/i.test(error.message);
    ui.model.textContent = unauthorized ? "API key needed: see Settings" : "server unreachable";
    ui.model.classList.add("offline");
  }
}

function effectiveTheme() {
  const theme = settings.theme;
  return theme === "system" ? (PREFERS_DARK.matches ? "dark" : "light") : theme;
}

// The theme is `data-theme` on <html> (style.css) and which highlight.js sheet applies.
function applyTheme() {
  const theme = settings.theme;
  if (theme === "system") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  $("code-light").media = theme === "system" ? "(prefers-color-scheme: light)" : theme === "light" ? "all" : "not all";
  $("code-dark").media = theme === "system" ? "(prefers-color-scheme: dark)" : theme === "dark" ? "all" : "not all";
  const other = effectiveTheme() === "dark" ? "light" : "dark";
  ui.toggleTheme.setAttribute("aria-label", `Switch to ${other} theme`);
}

// ---- the conversation list ----------------------------------------------------

function showSidebar(open) {
  ui.sidebar.classList.toggle("closed", !open);
  ui.toggleSidebar.setAttribute("aria-expanded", String(open));
}

function renderList() {
  const query = ui.search.value;
  const items = store.listConversations().filter((c) => store.matches(c, query));
  ui.list.replaceChildren(
    ...items.map((c) => {
      const item = document.createElement("li");
      item.className = "conversation-item";
      const open = document.createElement("button");
      open.type = "button";
      open.className = "conversation-title";
      open.textContent = c.title;
      open.title = c.title;
      if (conversation && c.id === conversation.id) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => {
        openConversation(c.id);
        if (NARROW.matches) showSidebar(false);
      });
      const rename = smallButton("✎", `Rename ${c.title}`, () => renameInline(item, c));
      const remove = smallButton("✕", `Delete ${c.title}`, () => {
        if (!window.confirm(`Delete "${c.title}"?`)) return;
        store.deleteConversation(c.id);
        if (conversation?.id === c.id) startNewConversation();
        renderList();
      });
      item.append(open, rename, remove);
      return item;
    }),
  );
}

function smallButton(text, label, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "ghost small";
  button.textContent = text;
  button.setAttribute("aria-label", label);
  button.title = label;
  button.addEventListener("click", onClick);
  return button;
}

function renameInline(item, c) {
  const field = document.createElement("input");
  field.type = "text";
  field.value = c.title;
  field.className = "rename";
  field.setAttribute("aria-label", "New title");
  item.replaceChildren(field);
  field.focus();
  field.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    const title = field.value.trim();
    if (keep && title) {
      const saved = conversation?.id === c.id ? conversation : c;
      saved.title = title.slice(0, 200);
      store.saveConversation(saved);
    }
    renderList();
  };
  field.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") {
      event.stopPropagation();
      finish(false);
    }
  });
  field.addEventListener("blur", () => finish(true));
}

function openConversation(id) {
  stopGeneration();
  conversation = store.listConversations().find((c) => c.id === id) ?? store.newConversation();
  localStorage.setItem("tandem.current", conversation.id);
  renderConversation();
  renderList();
  ui.input.focus();
}

function startNewConversation() {
  stopGeneration();
  conversation = store.newConversation(); // saved with its first message
  localStorage.removeItem("tandem.current");
  renderConversation();
  renderList();
  ui.input.focus();
}

// ---- messages ---------------------------------------------------------------------

function renderConversation() {
  const path = store.currentPath(conversation);
  ui.conversation.querySelectorAll(".message").forEach((node) => node.remove());
  ui.empty.hidden = path.length > 0;
  for (const message of path) ui.conversation.append(messageView(message));
  scrollToEnd(true);
}

function messageView(message) {
  const node = ui.template.content.firstElementChild.cloneNode(true);
  node.classList.add(message.role);
  node.dataset.id = message.id;
  node.querySelector(".role").textContent = message.role === "user" ? "You" : "Assistant";
  const content = node.querySelector(".content");
  // A person's own words show as typed; model output (and imports) as sanitized markdown.
  if (message.role === "user") content.textContent = message.content;
  else content.replaceChildren(renderMarkdown(message.content));
  showReasoning(node, message.reasoning, false);
  showToolCalls(node, message.toolCalls);
  showMeta(node, message);
  node.querySelector(".message-actions").replaceChildren(...messageActions(message));
  return node;
}

function showReasoning(node, reasoning, streaming) {
  const details = node.querySelector(".reasoning");
  details.hidden = !reasoning;
  if (streaming) details.open = true;
  node.querySelector(".reasoning-text").textContent = reasoning;
}

function showToolCalls(node, toolCalls) {
  node.querySelector(".tool-calls").replaceChildren(
    ...toolCalls.map((call) => {
      const details = document.createElement("details");
      details.className = "tool-call";
      details.open = true;
      const summary = document.createElement("summary");
      summary.textContent = `Tool call: ${call.name || "…"}`;
      const code = document.createElement("code");
      let args = call.arguments;
      try {
        args = JSON.stringify(JSON.parse(args), null, 2);
      } catch {
        // still streaming, or not JSON: shown as it came
      }
      code.textContent = args;
      const pre = document.createElement("pre");
      pre.append(code);
      details.append(summary, pre);
      return details;
    }),
  );
}

function describeStats(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.completionTokens !== null) parts.push(`${stats.completionTokens} tokens`);
  if (stats.tokensPerSecond !== null) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.ttft !== null) parts.push(`TTFT ${stats.ttft.toFixed(2)} s`);
  if (stats.finishReason) parts.push(stats.finishReason === "length" ? "length (token limit)" : stats.finishReason);
  return parts.join(" · ");
}

function showMeta(node, message) {
  const meta = node.querySelector(".meta");
  meta.classList.toggle("error", Boolean(message.error));
  meta.textContent = message.error ?? describeStats(message.stats);
}

function messageActions(message) {
  const actions = [];
  const siblings = store.siblingIds(conversation, message.parentId);
  if (siblings.length > 1) {
    const index = siblings.indexOf(message.id);
    const nav = document.createElement("span");
    nav.className = "branches";
    const position = document.createElement("span");
    position.className = "branch-position";
    position.textContent = `${index + 1}/${siblings.length}`;
    const go = (offset) => () => {
      if (generation) return;
      store.showBranch(conversation, siblings[index + offset]);
      store.saveConversation(conversation);
      renderConversation();
    };
    const previous = smallButton("‹", "Previous version", go(-1));
    previous.disabled = index === 0;
    const next = smallButton("›", "Next version", go(1));
    next.disabled = index === siblings.length - 1;
    nav.append(previous, position, next);
    actions.push(nav);
  }
  actions.push(smallButton("Copy", "Copy message", (event) => copyText(message.content, event.currentTarget)));
  if (message.role === "user") {
    actions.push(smallButton("Edit", "Edit and resend", (event) => editMessage(message, event.currentTarget)));
  } else {
    actions.push(smallButton("Regenerate", "Regenerate answer", () => !generation && generate(message.parentId)));
  }
  return actions;
}

function editMessage(message, button) {
  if (generation) return;
  const node = button.closest(".message");
  const content = node.querySelector(".content");
  const field = document.createElement("textarea");
  field.className = "edit-field";
  field.value = message.content;
  field.setAttribute("aria-label", "Edit message");
  const send = document.createElement("button");
  send.type = "button";
  send.textContent = "Send";
  const cancel = smallButton("Cancel", "Cancel edit", () => renderConversation());
  const submit = () => {
    const text = field.value.trim();
    if (!text) return;
    const edited = store.addMessage(conversation, message.parentId, { role: "user", content: text });
    store.saveConversation(conversation);
    renderConversation();
    generate(edited.id);
  };
  send.addEventListener("click", submit);
  field.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    } else if (event.key === "Escape") {
      event.stopPropagation();
      renderConversation();
    }
  });
  const bar = document.createElement("div");
  bar.className = "edit-actions";
  bar.append(send, cancel);
  content.replaceChildren(field, bar);
  field.focus();
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // Not a secure context (plain HTTP but localhost): the old way.
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = label), 1200);
}

function nearEnd() {
  const c = ui.conversation;
  return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
}

function scrollToEnd(force) {
  if (force || nearEnd()) ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

// ---- generating --------------------------------------------------------------------

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
}

function stopGeneration() {
  generation?.controller.abort();
}

/** Streams a new answer under `parentId`: a new branch if it already has one. */
async function generate(parentId) {
  const target = conversation;
  const path = store.currentPath(target);
  const history = path.slice(0, path.findIndex((m) => m.id === parentId) + 1);
  const message = store.addMessage(target, parentId, { role: "assistant" });
  store.saveConversation(target);
  renderConversation();
  renderList();
  const node = ui.conversation.querySelector(`[data-id="${message.id}"]`);
  node.classList.add("pending");
  node.setAttribute("aria-busy", "true");
  const content = new StreamingMarkdown(node.querySelector(".content"));
  const controller = new AbortController();
  generation = { controller };
  setBusy(true);

  const messages = [
    ...settings.systemMessage(),
    // An answer that was only tool calls or was stopped empty would break the turns' order.
    ...history.filter((m) => m.content || m.role === "user").map((m) => ({ role: m.role, content: m.content })),
  ];
  const body = { messages, stream: true, stream_options: { include_usage: true }, ...settings.requestFields() };
  if (modelName) body.model = modelName;
  let lastSave = performance.now();
  const update = (answer) => {
    message.content = answer.content;
    message.reasoning = answer.reasoning;
    message.toolCalls = answer.toolCalls.filter(Boolean);
    message.stats = answer.stats;
    content.update(answer.content);
    showReasoning(node, answer.reasoning, true);
    if (answer.toolCalls.length) showToolCalls(node, message.toolCalls);
    if (performance.now() - lastSave > SAVE_EVERY_MS) {
      store.saveConversation(target);
      lastSave = performance.now();
    }
    scrollToEnd(false);
  };
  try {
    await streamChat({ body, apiKey: settings.apiKey, signal: controller.signal, onUpdate: update });
  } catch (error) {
    message.error = error.message;
  } finally {
    content.finish();
    node.classList.remove("pending");
    node.removeAttribute("aria-busy");
    showMeta(node, message);
    target.updatedAt = Date.now();
    store.saveConversation(target);
    generation = null;
    setBusy(false);
    if (conversation === target) ui.input.focus();
  }
}

function sendNew(text) {
  if (!conversation) conversation = store.newConversation();
  const parentId = conversation.leafId;
  const question = store.addMessage(conversation, parentId, { role: "user", content: text });
  localStorage.setItem("tandem.current", conversation.id);
  generate(question.id);
}

// ---- import and export ------------------------------------------------------------

function exportConversations() {
  const blob = new Blob([JSON.stringify(store.exportAll(), null, 2)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `tandem-chats-${new Date().toISOString().slice(0, 10)}.json`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function importConversations(file) {
  try {
    const imported = store.importConversations(JSON.parse(await file.text()));
    ui.importStatus.textContent = `Imported ${imported.length} conversation${imported.length === 1 ? "" : "s"}.`;
    if (imported.length) openConversation(imported[0].id);
  } catch (error) {
    ui.importStatus.textContent = `Import failed: ${error.message}`;
  }
  renderList();
}

// ---- events --------------------------------------------------------------------------

function resizeInput() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${Math.min(ui.input.scrollHeight, 240)}px`;
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.input.value.trim();
  if (!text || generation) return;
  ui.input.value = "";
  resizeInput();
  sendNew(text);
});

ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});
ui.input.addEventListener("input", resizeInput);

// Aborting the fetch closes the connection, and the server aborts the request.
ui.stop.addEventListener("click", stopGeneration);
document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape") return;
  if (generation) stopGeneration();
  else if (NARROW.matches && !ui.sidebar.classList.contains("closed")) showSidebar(false);
});

ui.conversation.addEventListener("click", (event) => {
  const button = event.target.closest(".copy-code");
  if (button) copyText(button.closest(".code-block").querySelector("code").textContent, button);
});

ui.newChat.addEventListener("click", () => {
  startNewConversation();
  if (NARROW.matches) showSidebar(false);
});
ui.toggleSidebar.addEventListener("click", () => showSidebar(ui.sidebar.classList.contains("closed")));
ui.search.addEventListener("input", renderList);
ui.exportButton.addEventListener("click", exportConversations);
ui.importButton.addEventListener("click", () => ui.importFile.click());
ui.importFile.addEventListener("change", () => {
  const file = ui.importFile.files[0];
  if (file) importConversations(file);
  ui.importFile.value = "";
});
ui.toggleTheme.addEventListener("click", () => {
  settings.theme = effectiveTheme() === "dark" ? "light" : "dark";
  applyTheme();
});
PREFERS_DARK.addEventListener("change", applyTheme);

applyTheme();
showSidebar(!NARROW.matches);
loadModel();
new EnginePanel((online) => {
  if (online && !modelName) loadModel();
}).start();
const current = localStorage.getItem("tandem.current");
if (current) openConversation(current);
else startNewConversation();
