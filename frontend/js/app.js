// Tandem's web chat: conversations (store.js, kept by storage.js) shown as messages, answers
// streamed from /v1/chat/completions (api.js) and rendered as sanitized markdown
// (markdown.js), settings (settings.js), the panels (panels.js) and the live engine panel
// (engine_panel.js). No build step: ES modules served as they are.
//
// Answers stream into their own conversation: opening another conversation, or starting a
// new one, leaves them running (`streams`, one a conversation), and the page shows whichever
// is open, as it stands, when it is opened.

import { fetchModel, streamChat } from "./api.js";
import { describeSize, readTextFile, withAttachments } from "./attachments.js";
import { EnginePanel } from "./engine_panel.js";
import { StreamingJson, StreamingMarkdown, renderJson, renderMarkdown } from "./markdown.js";
import { Panel, closeTopPanel, initPanels } from "./panels.js";
import { Settings } from "./settings.js";
import { ConversationStore, describeStorageError } from "./storage.js";
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
  attach: $("attach"),
  attachFile: $("attach-file"),
  pendingAttachments: $("pending-attachments"),
  search: $("search"),
  list: $("conversation-list"),
  importFile: $("import-file"),
  importStatus: $("import-status"),
  toggleTheme: $("toggle-theme"),
  notice: $("notice"),
  noticeText: $("notice-text"),
  template: $("message-template"),
};

const SIDEBAR_OVERLAYS = window.matchMedia("(max-width: 799px)");
const ENGINE_OVERLAYS = window.matchMedia("(max-width: 1099px)");
const PREFERS_DARK = window.matchMedia("(prefers-color-scheme: dark)");
const SAVE_EVERY_MS = 1000; // while an answer streams, it is saved this often
// A question longer than this shows folded, with a button to unfold it.
const FOLD_CHARACTERS = 1500;
const FOLD_LINES = 20;

let modelName = null;
let conversations = null; // the ConversationStore
let conversation = null; // the one shown
const streams = new Map(); // conversation id -> the answer streaming into it (generate())
let attachments = []; // files attached to the question being written

const settings = new Settings((name) => {
  if (name === "apiKey") loadModel();
  if (name === "theme") applyTheme();
});

// ---- notices ------------------------------------------------------------------------

/** A problem the user should know of (storage full), shown until dismissed or replaced. */
function showNotice(text) {
  ui.noticeText.textContent = text;
  ui.notice.hidden = false;
}

$("close-notice").addEventListener("click", () => (ui.notice.hidden = true));

// ---- model and theme --------------------------------------------------------

async function loadModel() {
  try {
    const card = await fetchModel(settings.apiKey);
    modelName = card.id;
    ui.model.replaceChildren(card.id);
    const context = document.createElement("span");
    context.className = "model-context";
    context.textContent = ` · ${card.max_model_len} tokens of context`;
    ui.model.append(context);
    ui.model.title = `${card.id}, ${card.max_model_len} tokens of context`;
    ui.model.classList.remove("offline");
    settings.setModelDefaults(card.sampling_defaults);
  } catch (error) {
    const unauthorized = /api key/i.test(error.message);
    ui.model.textContent = unauthorized ? "API key needed: see Settings" : "server not answering";
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

// ---- panels ----------------------------------------------------------------------------

initPanels($("scrim"));
const sidebar = new Panel({
  element: $("sidebar"),
  toggle: $("toggle-sidebar"),
  close: $("close-sidebar"),
  overlayQuery: SIDEBAR_OVERLAYS,
  drawer: true,
});
let enginePanel = null;
const engineDrawer = new Panel({
  element: $("engine-panel"),
  toggle: $("toggle-engine"),
  close: $("close-engine"),
  overlayQuery: ENGINE_OVERLAYS,
  drawer: true,
  onShow: (visible) => {
    // Remembered where it sits beside the chat; over the chat it starts closed.
    if (!ENGINE_OVERLAYS.matches) localStorage.setItem("tandem.enginePanel", visible ? "shown" : "hidden");
    if (visible) enginePanel?.refresh();
  },
});
const settingsPanel = new Panel({ element: $("settings"), toggle: $("toggle-settings"), close: $("close-settings") });

/** Closes the conversation list where it lies over the chat (after picking from it). */
function closeSidebarDrawer() {
  if (SIDEBAR_OVERLAYS.matches && sidebar.open) sidebar.show(false, { focus: false });
}

// ---- the conversation list ----------------------------------------------------

function renderList() {
  const query = ui.search.value;
  const items = conversations.list().filter((c) => store.matches(c, query));
  ui.list.replaceChildren(
    ...items.map((c) => {
      const item = document.createElement("li");
      item.className = "conversation-item";
      const open = document.createElement("button");
      open.type = "button";
      open.className = "conversation-title";
      open.textContent = c.title;
      open.title = c.title;
      if (streams.has(c.id)) open.classList.add("streaming");
      if (conversation && c.id === conversation.id) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => {
        openConversation(c.id);
        closeSidebarDrawer();
      });
      const rename = smallButton("✎", `Rename ${c.title}`, () => renameInline(item, c));
      const remove = smallButton("✕", `Delete ${c.title}`, () => {
        if (!window.confirm(`Delete "${c.title}"?`)) return;
        streams.get(c.id)?.controller.abort();
        conversations.delete(c.id);
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
      c.title = title.slice(0, 200);
      conversations.save(c);
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
  conversation = conversations.get(id) ?? store.newConversation();
  localStorage.setItem("tandem.current", conversation.id);
  renderConversation();
  renderList();
  ui.input.focus();
}

function startNewConversation() {
  conversation = store.newConversation(); // saved with its first message
  localStorage.removeItem("tandem.current");
  renderConversation();
  renderList();
  ui.input.focus();
}

// ---- messages ---------------------------------------------------------------------

function shown(target) {
  return conversation === target;
}

function renderConversation() {
  // The answers streaming elsewhere lose their views; the shown one's is made again below.
  for (const stream of streams.values()) stream.view = stream.node = null;
  const path = store.currentPath(conversation);
  ui.conversation.querySelectorAll(".message").forEach((node) => node.remove());
  ui.empty.hidden = path.length > 0;
  for (const message of path) ui.conversation.append(messageView(message));
  updateComposer();
  scrollToEnd(true);
}

function renderOptions() {
  return { remoteImages: conversation.allowRemoteImages };
}

function messageView(message) {
  const node = ui.template.content.firstElementChild.cloneNode(true);
  node.classList.add(message.role);
  node.dataset.id = message.id;
  node.querySelector(".role").textContent =
    message.role === "user" ? "You" : message.role === "tool" ? `Tool result: ${message.toolName || "tool"}` : "Assistant";
  const content = node.querySelector(".content");
  const stream = streams.get(conversation.id);
  if (stream?.message === message) {
    // Streaming: a view that the stream's updates extend (generate()).
    stream.node = node;
    stream.view = streamingView(content, message);
    stream.view.update(message.content);
    node.classList.add("pending");
    node.setAttribute("aria-busy", "true");
  } else if (message.role === "user") {
    // A person's own words show as typed.
    content.textContent = message.content;
    foldIfLong(node, content, message.content);
  } else if (message.role === "tool") {
    const pre = document.createElement("pre");
    pre.textContent = message.content;
    content.replaceChildren(pre);
  } else if (message.format === "json") {
    content.replaceChildren(renderJson(message.content));
  } else {
    // Model output (and imports): sanitized markdown.
    content.replaceChildren(renderMarkdown(message.content, renderOptions()));
  }
  showAttachments(node, message.attachments ?? []); // none in conversations older than attachments
  showReasoning(node, message.reasoning, false);
  showToolCalls(node, message);
  showMeta(node, message);
  node.querySelector(".message-actions").replaceChildren(...messageActions(message));
  return node;
}

function streamingView(content, message) {
  return message.format === "json" ? new StreamingJson(content) : new StreamingMarkdown(content, renderOptions());
}

// A long paste shows its first lines, with a button for the rest.
function foldIfLong(node, content, text) {
  if (text.length <= FOLD_CHARACTERS && text.split("\n").length <= FOLD_LINES) return;
  content.classList.add("folded");
  const toggle = document.createElement("button");
  toggle.type = "button";
  toggle.className = "ghost small fold-toggle";
  const label = () =>
    content.classList.contains("folded") ? `Show all (${text.length.toLocaleString("en")} characters)` : "Show less";
  toggle.textContent = label();
  toggle.setAttribute("aria-expanded", "false");
  toggle.addEventListener("click", () => {
    const folded = content.classList.toggle("folded");
    toggle.setAttribute("aria-expanded", String(!folded));
    toggle.textContent = label();
  });
  content.after(toggle);
}

function showAttachments(node, files) {
  node.querySelector(".attachments").replaceChildren(
    ...files.map((file) => {
      const details = document.createElement("details");
      details.className = "attachment";
      const summary = document.createElement("summary");
      summary.textContent = `📄 ${file.name} · ${describeSize(file.text)}`;
      const pre = document.createElement("pre");
      pre.textContent = file.text;
      details.append(summary, pre);
      return details;
    }),
  );
}

function showReasoning(node, reasoning, streaming) {
  const details = node.querySelector(".reasoning");
  details.hidden = !reasoning;
  if (streaming) details.open = true;
  node.querySelector(".reasoning-text").textContent = reasoning;
}

// The answer's tool calls, each in its box. Under the last answer, when no result has been
// given yet, each box takes the user's result, and "Send results" sends them back as tool
// messages for the model to go on.
function showToolCalls(node, message) {
  const awaiting = message.toolCalls.length > 0 && !streams.has(conversation.id) && !message.childIds.length && !message.error;
  const fields = [];
  const boxes = message.toolCalls.map((call) => {
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
    if (awaiting) {
      const field = document.createElement("textarea");
      field.className = "tool-result-field";
      field.rows = 2;
      field.placeholder = "The result, as the tool would return it";
      field.setAttribute("aria-label", `Result of ${call.name}`);
      fields.push([call, field]);
      details.append(field);
    }
    return details;
  });
  if (awaiting) {
    const send = document.createElement("button");
    send.type = "button";
    send.className = "send-tool-results";
    send.textContent = "Send results";
    send.addEventListener("click", () => sendToolResults(message, fields));
    boxes.push(send);
  }
  node.querySelector(".tool-calls").replaceChildren(...boxes);
}

function sendToolResults(message, fields) {
  if (streams.has(conversation.id)) return;
  let parentId = message.id;
  for (const [call, field] of fields) {
    const result = store.addMessage(conversation, parentId, {
      role: "tool",
      content: field.value,
      toolCallId: call.id,
      toolName: call.name,
    });
    parentId = result.id;
  }
  generate(conversation, parentId);
}

function describeStats(stats) {
  if (!stats) return "";
  const parts = [];
  // `!= null`: a field may be missing as well as null (conversations saved by older pages).
  if (stats.completionTokens != null) parts.push(`${stats.completionTokens} tokens`);
  if (stats.tokensPerSecond != null) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.ttft != null) parts.push(`TTFT ${stats.ttft.toFixed(2)} s`);
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
      if (streams.has(conversation.id)) return;
      store.showBranch(conversation, siblings[index + offset]);
      conversations.save(conversation);
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
  const idle = () => !streams.has(conversation.id);
  if (message.role === "user") {
    actions.push(smallButton("Edit", "Edit and resend", (event) => editMessage(message, event.currentTarget)));
  } else if (message.role === "assistant") {
    actions.push(smallButton("Regenerate", "Regenerate answer", () => idle() && generate(conversation, message.parentId)));
    // An answer cut at the token limit goes on where it stopped, as the same message.
    if (message.stats?.finishReason === "length" && !message.childIds.length) {
      actions.push(
        smallButton("Continue", "Continue the answer", () => idle() && generate(conversation, message.parentId, message)),
      );
    }
  }
  return actions;
}

function editMessage(message, button) {
  if (streams.has(conversation.id)) return;
  const node = button.closest(".message");
  const content = node.querySelector(".content");
  node.querySelector(".fold-toggle")?.remove();
  content.classList.remove("folded");
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
    const files = message.attachments ?? [];
    if (!text && !files.length) return;
    const edited = store.addMessage(conversation, message.parentId, { role: "user", content: text, attachments: files });
    generate(conversation, edited.id);
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

// Send or Stop, for the conversation shown: another one's answer streams on regardless.
function updateComposer() {
  const busy = Boolean(conversation && streams.has(conversation.id));
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
}

function stopShownAnswer() {
  if (conversation) streams.get(conversation.id)?.controller.abort();
}

// The conversation's messages as the API takes them.
function apiMessages(history) {
  const messages = [];
  for (const m of history) {
    if (m.role === "user") {
      messages.push({ role: "user", content: withAttachments(m.content, m.attachments ?? []) });
    } else if (m.role === "tool") {
      messages.push({ role: "tool", tool_call_id: m.toolCallId, content: m.content });
    } else if (m.toolCalls.length) {
      messages.push({
        role: "assistant",
        content: m.content || null,
        tool_calls: m.toolCalls.map((call) => ({
          id: call.id,
          type: "function",
          function: { name: call.name, arguments: call.arguments },
        })),
      });
    } else if (m.content) {
      // An answer stopped empty or failed would break the turns' order: left out.
      messages.push({ role: "assistant", content: m.content });
    }
  }
  return messages;
}

/**
 * Streams a new answer under `parentId` in `target` (a new branch if it already has one);
 * with `continued`, an answer cut at the token limit, goes on with that one instead (vLLM's
 * continue_final_message: the answer so far is the prompt's last, unfinished message).
 */
async function generate(target, parentId, continued = null) {
  if (streams.has(target.id)) return;
  const path = store.currentPath(target);
  const history = path.slice(0, path.findIndex((m) => m.id === (continued ? continued.id : parentId)) + 1);
  const message =
    continued ?? store.addMessage(target, parentId, { role: "assistant", format: settings.jsonMode ? "json" : null });
  const before = { content: message.content, reasoning: message.reasoning, tokens: message.stats?.completionTokens ?? 0 };
  message.error = null;
  const stream = { controller: new AbortController(), message, view: null, node: null };
  streams.set(target.id, stream);
  conversations.save(target);
  if (shown(target)) renderConversation();
  renderList();

  const body = {
    messages: [...settings.systemMessage(), ...apiMessages(history)],
    stream: true,
    stream_options: { include_usage: true },
    ...settings.requestFields(),
  };
  if (message.format === "json") body.response_format = { type: "json_object" };
  if (continued) Object.assign(body, { continue_final_message: true, add_generation_prompt: false });
  if (modelName) body.model = modelName;
  let lastSave = performance.now();
  const update = (answer) => {
    message.content = before.content + answer.content;
    message.reasoning = before.reasoning + answer.reasoning;
    message.toolCalls = answer.toolCalls.filter(Boolean);
    message.stats = answer.stats && {
      ...answer.stats,
      completionTokens: answer.stats.completionTokens === null ? null : before.tokens + answer.stats.completionTokens,
    };
    if (stream.view) {
      stream.view.update(message.content);
      showReasoning(stream.node, message.reasoning, true);
      if (message.toolCalls.length) showToolCalls(stream.node, message);
      scrollToEnd(false);
    }
    if (performance.now() - lastSave > SAVE_EVERY_MS) {
      saveUnlessDeleted(target);
      lastSave = performance.now();
    }
  };
  try {
    await streamChat({ body, apiKey: settings.apiKey, signal: stream.controller.signal, onUpdate: update });
  } catch (error) {
    message.error = error.message;
  } finally {
    streams.delete(target.id);
    stream.view?.finish();
    target.updatedAt = Date.now();
    saveUnlessDeleted(target);
    if (stream.node) {
      const view = messageView(message);
      stream.node.replaceWith(view);
      scrollToEnd(false);
    }
    if (shown(target)) {
      updateComposer();
      ui.input.focus();
    }
    renderList();
  }
}

// A conversation deleted while its answer streamed stays deleted.
function saveUnlessDeleted(target) {
  if (conversations.get(target.id) === target) conversations.save(target);
}

function sendNew(text) {
  if (!conversation) conversation = store.newConversation();
  const question = store.addMessage(conversation, conversation.leafId, { role: "user", content: text, attachments });
  if (conversation.title === "New chat" && attachments.length) {
    conversation.title = attachments.map((file) => file.name).join(", ").slice(0, 48);
  }
  attachments = [];
  renderPendingAttachments();
  localStorage.setItem("tandem.current", conversation.id);
  generate(conversation, question.id);
}

// ---- attachments ---------------------------------------------------------------------

function renderPendingAttachments(problem = "") {
  const chips = attachments.map((file, i) => {
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.textContent = `📄 ${file.name} · ${describeSize(file.text)}`;
    chip.append(
      smallButton("✕", `Remove ${file.name}`, () => {
        attachments.splice(i, 1);
        renderPendingAttachments();
      }),
    );
    return chip;
  });
  if (problem) {
    const note = document.createElement("span");
    note.className = "attach-problem";
    note.setAttribute("role", "alert");
    note.textContent = problem;
    chips.push(note);
  }
  ui.pendingAttachments.replaceChildren(...chips);
}

async function attachFiles(files) {
  const problems = [];
  for (const file of files) {
    try {
      attachments.push(await readTextFile(file));
    } catch (error) {
      problems.push(error.message);
    }
  }
  renderPendingAttachments(problems.join(" "));
}

// ---- import and export ------------------------------------------------------------

function exportConversations() {
  const blob = new Blob([JSON.stringify(store.exportAll(conversations.list()), null, 2)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `tandem-chats-${new Date().toISOString().slice(0, 10)}.json`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function importConversations(file) {
  try {
    const imported = store.importConversations(JSON.parse(await file.text()));
    for (const c of imported) conversations.save(c);
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
  if ((!text && !attachments.length) || (conversation && streams.has(conversation.id))) return;
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
ui.attach.addEventListener("click", () => ui.attachFile.click());
ui.attachFile.addEventListener("change", () => {
  attachFiles([...ui.attachFile.files]);
  ui.attachFile.value = "";
});

// Aborting the fetch closes the connection, and the server aborts the request.
ui.stop.addEventListener("click", stopShownAnswer);

// Keyboard shortcuts (llama.cpp's): Esc closes the panel on top, else stops the shown
// answer; Ctrl+Shift+O starts a new chat; Ctrl+K searches the conversations.
document.addEventListener("keydown", (event) => {
  if (!conversations) return; // still opening the storage
  const mod = event.ctrlKey || event.metaKey;
  if (event.key === "Escape") {
    if (!closeTopPanel()) stopShownAnswer();
  } else if (mod && event.shiftKey && event.key.toLowerCase() === "o") {
    event.preventDefault();
    startNewConversation();
    closeSidebarDrawer();
  } else if (mod && !event.shiftKey && event.key.toLowerCase() === "k") {
    event.preventDefault();
    if (!sidebar.open) sidebar.show(true, { focus: false });
    ui.search.focus();
    ui.search.select();
  }
});

ui.conversation.addEventListener("click", (event) => {
  const copy = event.target.closest(".copy-code");
  if (copy) copyText(copy.closest(".code-block").querySelector("code").textContent, copy);
  // A remote image's placeholder: the user allows this conversation's remote images.
  if (event.target.closest(".remote-image") && conversation) {
    conversation.allowRemoteImages = true;
    conversations.save(conversation);
    renderConversation();
  }
});

$("new-chat").addEventListener("click", () => {
  startNewConversation();
  closeSidebarDrawer();
});
ui.search.addEventListener("input", renderList);
$("export").addEventListener("click", exportConversations);
$("import").addEventListener("click", () => ui.importFile.click());
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

// ---- start ---------------------------------------------------------------------------

applyTheme();
sidebar.show(!SIDEBAR_OVERLAYS.matches, { focus: false });
const savedEngine = localStorage.getItem("tandem.enginePanel");
engineDrawer.show(!ENGINE_OVERLAYS.matches && (savedEngine === null || savedEngine === "shown"), { focus: false });
settingsPanel.show(false, { focus: false });
loadModel();
enginePanel = new EnginePanel((online) => {
  if (online && !modelName) loadModel();
});
enginePanel.start();
conversations = await ConversationStore.open(
  (error, c) => showNotice(describeStorageError(error, c)),
  (saving) => document.documentElement.toggleAttribute("data-saving", saving),
);
addEventListener("pagehide", () => conversations.flush());
// Disabled in index.html until now: a question sent before the conversations were read had
// nowhere to be saved, and the conversation opened next replaced it.
ui.input.disabled = ui.send.disabled = false;
const current = localStorage.getItem("tandem.current");
if (current) openConversation(current);
else startNewConversation();
