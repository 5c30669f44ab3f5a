// Where conversations are kept: the browser's IndexedDB (database "tandem", one record a
// conversation), which holds as much as the browser grants the site instead of
// localStorage's ~5 M characters. No library: the few calls below are all it takes.
//
// Every conversation is read once at start and kept in memory, so the page lists, searches
// and opens them without waiting. A save writes in the background: the page never waits for
// it, and a failed one (the storage is full, or the browser refuses IndexedDB) is handed to
// `onError` for the page to say so, while the chat goes on. The newest version of each
// conversation is written; saves of one that is still being written wait and coalesce, until
// the page goes away (`flush`). `onSaving` hears whether any write is pending: the page marks
// itself (`data-saving`) until what it shows is what a reload would read.
//
// Conversations that an older page kept in localStorage (`tandem.conversation.<id>`) move
// here once: copied in one transaction, then removed from localStorage.

const DATABASE = "tandem";
const STORE = "conversations";
const LEGACY_PREFIX = "tandem.conversation.";

function request(req) {
  return new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

// Resolves when the transaction commits; rejects with its error (QuotaExceededError surfaces
// here, as the transaction aborts).
function committed(transaction) {
  return new Promise((resolve, reject) => {
    transaction.oncomplete = () => resolve();
    transaction.onabort = () => reject(transaction.error ?? new DOMException("aborted", "AbortError"));
    transaction.onerror = () => reject(transaction.error);
  });
}

function openDatabase() {
  const opening = indexedDB.open(DATABASE, 1);
  opening.onupgradeneeded = () => opening.result.createObjectStore(STORE, { keyPath: "id" });
  return request(opening);
}

/** Why a save failed, in words a user can act on. */
export function describeStorageError(error, conversation) {
  const what = conversation ? `“${conversation.title}”` : "your conversations";
  if (error?.name === "QuotaExceededError") {
    return (
      `The browser's storage for this site is full: ${what} could not be saved. ` +
      "The chat goes on, but a reload would lose what was not saved: export and delete old conversations to make room."
    );
  }
  return `Could not save ${what}: ${error?.message || error}. The chat goes on, but a reload would lose it.`;
}

export class ConversationStore {
  /** Opens the database, moves localStorage's conversations in, and reads them all. */
  static async open(onError, onSaving) {
    const store = new ConversationStore(onError, onSaving);
    try {
      store.db = await openDatabase();
    } catch (error) {
      // Private windows of some browsers have no IndexedDB: the chat works, unsaved.
      onError(error, null);
    }
    if (store.db) {
      await store.migrateLocalStorage();
      const all = await request(store.db.transaction(STORE).objectStore(STORE).getAll());
      for (const conversation of all) store.cache.set(conversation.id, conversation);
    }
    return store;
  }

  constructor(onError, onSaving = () => {}) {
    this.onError = onError; // (error, conversation | null) => void
    this.onSaving = onSaving; // (saving) => void: whether a write is in flight or queued
    this.db = null;
    this.cache = new Map(); // id -> conversation: every conversation, as the page has it
    this.writing = new Map(); // id -> the write in flight
    this.queued = new Set(); // ids saved again while their write was in flight
  }

  async migrateLocalStorage() {
    const keys = [];
    for (let i = 0; i < localStorage.length; i++) {
      const key = localStorage.key(i);
      if (key.startsWith(LEGACY_PREFIX)) keys.push(key);
    }
    if (!keys.length) return;
    const transaction = this.db.transaction(STORE, "readwrite");
    const objects = transaction.objectStore(STORE);
    for (const key of keys) {
      try {
        objects.put(JSON.parse(localStorage.getItem(key)));
      } catch {
        // unreadable: nothing could show it; dropped below with the rest
      }
    }
    try {
      await committed(transaction);
    } catch (error) {
      this.onError(error, null); // left in localStorage, to move at the next start
      return;
    }
    for (const key of keys) localStorage.removeItem(key);
  }

  /** Every conversation, the latest first. */
  list() {
    return [...this.cache.values()].sort((a, b) => b.updatedAt - a.updatedAt);
  }

  get(id) {
    return this.cache.get(id) ?? null;
  }

  /** Keeps `conversation` (the page goes on at once; the write follows). */
  save(conversation) {
    this.cache.set(conversation.id, conversation);
    if (!this.db) return;
    if (this.writing.has(conversation.id)) {
      this.queued.add(conversation.id);
      this.notify();
      return;
    }
    this.write(conversation.id);
  }

  /** Starts every queued write now, not after the one before it: the page is going away. */
  flush() {
    for (const id of this.queued) {
      this.queued.delete(id);
      this.write(id);
    }
  }

  notify() {
    this.onSaving(this.writing.size > 0 || this.queued.size > 0);
  }

  async write(id) {
    const conversation = this.cache.get(id);
    if (!conversation) return;
    // put() copies the conversation now: later changes go in the next write.
    const transaction = this.db.transaction(STORE, "readwrite");
    transaction.objectStore(STORE).put(conversation);
    const done = committed(transaction);
    this.writing.set(id, done);
    this.notify();
    try {
      await done;
    } catch (error) {
      this.onError(error, conversation);
    } finally {
      this.writing.delete(id);
    }
    if (this.queued.delete(id)) this.write(id);
    this.notify();
  }

  delete(id) {
    this.cache.delete(id);
    this.queued.delete(id);
    this.notify();
    if (!this.db) return;
    const transaction = this.db.transaction(STORE, "readwrite");
    transaction.objectStore(STORE).delete(id);
    committed(transaction).catch((error) => this.onError(error, null));
  }
}
