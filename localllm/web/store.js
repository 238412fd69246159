// Conversations, kept in the browser's IndexedDB: one record per conversation, written as it changes, so a reload
// or a server restart mid-answer loses nothing.

const DB = "localllm";
const STORE = "conversations";

let opened = null;

function database() {
  opened ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DB, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE, { keyPath: "id" });
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  return opened;
}

async function run(mode, action) {
  const db = await database();
  return new Promise((resolve, reject) => {
    const transaction = db.transaction(STORE, mode);
    const request = action(transaction.objectStore(STORE));
    transaction.oncomplete = () => resolve(request.result);
    transaction.onerror = () => reject(transaction.error);
  });
}

// crypto.randomUUID needs a secure context; a page reached over plain http from another machine is not one.
function newId() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return Date.now().toString(36) + "-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

export function newConversation(model) {
  const now = Date.now();
  return { id: newId(), title: "", model, created: now, updated: now, settings: {}, messages: [] };
}

export async function allConversations() {
  const rows = await run("readonly", (store) => store.getAll());
  return rows.sort((a, b) => b.updated - a.updated);
}

export function saveConversation(conversation) {
  conversation.updated = Date.now();
  // A structured clone of plain data: the record never shares objects with the page.
  return run("readwrite", (store) => store.put(JSON.parse(JSON.stringify(conversation))));
}

export function deleteConversation(id) {
  return run("readwrite", (store) => store.delete(id));
}

// Imported JSON: one conversation, a list, or an export ({"conversations": [...]}). Each is checked for the fields
// the page reads; a bad one is an error naming it.
export function parseImport(text) {
  const data = JSON.parse(text);
  const list = Array.isArray(data) ? data : Array.isArray(data.conversations) ? data.conversations : [data];
  return list.map((item, index) => {
    if (!item || !Array.isArray(item.messages)) {
      throw new Error(`conversation ${index + 1} has no "messages" list`);
    }
    const messages = item.messages.map((m, n) => {
      if (!["user", "assistant", "system"].includes(m?.role) || typeof m.content !== "string") {
        throw new Error(`conversation ${index + 1}, message ${n + 1}: needs a role and a text content`);
      }
      return m;
    });
    const fresh = newConversation(typeof item.model === "string" ? item.model : "");
    fresh.title = typeof item.title === "string" ? item.title : "";
    fresh.settings = item.settings && typeof item.settings === "object" ? item.settings : {};
    fresh.messages = messages;
    return fresh;
  });
}
