// Conversations as trees of messages (storage.js keeps them).
//
// A conversation is a tree, as llama.cpp's web UI keeps it: editing a question or
// regenerating an answer adds a sibling instead of overwriting, and `leafId` says which
// branch is shown. A message: {id, parentId, childIds, role, content, reasoning, toolCalls,
// toolCallId, toolName, attachments, format, stats, error, createdAt}; the first messages' parent is
// null (`rootIds`). Roles: user, assistant, and tool (a result the user entered for one of
// the assistant's tool calls). `allowRemoteImages`: the user let this conversation's
// answers load images from other hosts (markdown.js).

export const EXPORT_TYPE = "tandem-conversations";
const MAX_TEXT = 1_000_000; // characters of one imported text: more is cut
const ROLES = ["user", "assistant", "tool"];

export function newId() {
  return crypto.randomUUID();
}

export function newConversation() {
  const now = Date.now();
  return {
    id: newId(),
    title: "New chat",
    createdAt: now,
    updatedAt: now,
    rootIds: [],
    messages: {},
    leafId: null,
    allowRemoteImages: false,
  };
}

/** Adds a message under `parentId` (null: a first message) and shows its branch. */
export function addMessage(conversation, parentId, fields) {
  const message = {
    id: newId(),
    parentId,
    childIds: [],
    role: fields.role,
    content: fields.content ?? "",
    reasoning: fields.reasoning ?? "",
    toolCalls: fields.toolCalls ?? [],
    toolCallId: fields.toolCallId ?? null,
    toolName: fields.toolName ?? null,
    attachments: fields.attachments ?? [],
    format: fields.format ?? null, // "json": a JSON-mode answer
    stats: fields.stats ?? null,
    error: fields.error ?? null,
    createdAt: fields.createdAt ?? Date.now(),
  };
  conversation.messages[message.id] = message;
  siblingIds(conversation, parentId).push(message.id);
  conversation.leafId = message.id;
  conversation.updatedAt = message.createdAt;
  if (conversation.title === "New chat" && message.role === "user") {
    conversation.title = titleOf(message.content);
  }
  return message;
}

function titleOf(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || "New chat";
}

/** The ids of `parentId`'s children: the branches one message can be switched between. */
export function siblingIds(conversation, parentId) {
  return parentId === null ? conversation.rootIds : conversation.messages[parentId].childIds;
}

/** The shown branch, first message first. */
export function currentPath(conversation) {
  const path = [];
  for (let id = conversation.leafId; id; id = conversation.messages[id].parentId) {
    path.push(conversation.messages[id]);
  }
  return path.reverse();
}

/** Shows the branch through `messageId`: down its latest children to a leaf. */
export function showBranch(conversation, messageId) {
  let id = messageId;
  for (let children = conversation.messages[id].childIds; children.length; ) {
    id = children[children.length - 1];
    children = conversation.messages[id].childIds;
  }
  conversation.leafId = id;
}

export function matches(conversation, query) {
  const needle = query.trim().toLowerCase();
  if (!needle) return true;
  if (conversation.title.toLowerCase().includes(needle)) return true;
  return Object.values(conversation.messages).some((m) => m.content.toLowerCase().includes(needle));
}

export function exportAll(conversations) {
  return { type: EXPORT_TYPE, version: 1, exportedAt: new Date().toISOString(), conversations };
}

// ---- import ----------------------------------------------------------------
//
// An imported file is as untrusted as model output: it is rebuilt field by field (known
// fields, checked types, fresh ids, so nothing of it becomes an object key or a property
// it did not earn), and its texts go through the same sanitizing renderer as answers.

function text(value, limit = MAX_TEXT) {
  return typeof value === "string" ? value.slice(0, limit) : "";
}

function number(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

// A time as milliseconds since 1970: ours are numbers, other tools' exports ISO strings.
function time(value) {
  if (typeof value === "string") {
    const parsed = Date.parse(value);
    return Number.isFinite(parsed) ? parsed : null;
  }
  return number(value);
}

function importedStats(stats) {
  if (!stats || typeof stats !== "object") return null;
  return {
    ttft: number(stats.ttft),
    tokensPerSecond: number(stats.tokensPerSecond),
    promptTokens: number(stats.promptTokens),
    completionTokens: number(stats.completionTokens),
    finishReason: text(stats.finishReason, 40) || null,
  };
}

function importedAttachments(attachments) {
  if (!Array.isArray(attachments)) return [];
  return attachments.map((file) => ({ name: text(file?.name, 200) || "file", text: text(file?.text) }));
}

function importedToolCalls(calls) {
  if (!Array.isArray(calls)) return [];
  return calls.map((call) => ({
    id: text(call?.id, 200),
    name: text(call?.name, 200),
    arguments: text(call?.arguments),
  }));
}

// The messages as a list of {role, content} (OpenAI's shape) or our tree; either way a tree.
function importedConversation(raw) {
  const conversation = newConversation();
  conversation.title = text(raw?.title, 200) || "Imported chat";
  const created = time(raw?.createdAt);
  if (created) conversation.createdAt = created;
  const source = raw?.messages;
  const ids = new Map(); // the file's id -> ours
  const times = []; // the messages' times the file gives
  const list = Array.isArray(source)
    ? source.map((m, i) => ({ ...m, id: String(i), parentId: i ? String(i - 1) : null }))
    : source && typeof source === "object"
      ? Object.values(source)
      : [];
  // Parents first, whatever the file's order: at most one pass per depth.
  const pending = list.filter((m) => m && typeof m === "object");
  for (let progress = true; pending.length && progress; ) {
    progress = false;
    for (let i = 0; i < pending.length; i++) {
      const m = pending[i];
      const parent = m.parentId === null || m.parentId === undefined ? null : ids.get(String(m.parentId));
      if (parent === undefined) continue;
      const role = ROLES.includes(m.role) ? m.role : null;
      pending.splice(i--, 1);
      progress = true;
      if (!role) {
        ids.set(String(m.id), parent); // a system message: its children move up
        continue;
      }
      const message = addMessage(conversation, parent, {
        role,
        content: text(m.content),
        reasoning: text(m.reasoning),
        toolCalls: importedToolCalls(m.toolCalls),
        toolCallId: text(m.toolCallId ?? m.tool_call_id, 200) || null,
        toolName: text(m.toolName ?? m.name, 200) || null,
        attachments: importedAttachments(m.attachments),
        format: m.format === "json" ? "json" : null,
        stats: importedStats(m.stats),
        error: text(m.error, 2000) || null,
        createdAt: time(m.createdAt) ?? undefined,
      });
      if (time(m.createdAt)) times.push(time(m.createdAt));
      ids.set(String(m.id), message.id);
    }
  }
  const leaf = ids.get(String(raw?.leafId));
  if (leaf) conversation.leafId = leaf;
  conversation.title = text(raw?.title, 200) || conversation.title;
  // It sorts among the others by its own last activity, not by when it was imported.
  const latest = times.length ? Math.max(...times) : null;
  conversation.updatedAt = time(raw?.updatedAt) ?? latest ?? created ?? Date.now();
  return conversation;
}

/** Conversations from an export file's parsed JSON (ours, one conversation, or a message list). */
export function importConversations(data) {
  let raws;
  if (data?.type === EXPORT_TYPE && Array.isArray(data.conversations)) raws = data.conversations;
  else if (Array.isArray(data)) raws = [{ title: "Imported chat", messages: data }];
  else if (data && typeof data === "object" && "messages" in data) raws = [data];
  else throw new Error("not a conversation export: expected Tandem's export or a list of messages");
  return raws.map(importedConversation).filter((c) => c.leafId);
}
