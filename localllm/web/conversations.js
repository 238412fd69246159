// The conversation list: search, open, rename, delete, export and import (JSON).

import { el } from "./render.js";
import { allConversations, deleteConversation, parseImport, saveConversation } from "./store.js";

const $ = (id) => document.getElementById(id);

let handlers = null; // {open(conversation), current(), startNew(), error(text)}

export function initConversations(given) {
  handlers = given;
  $("new-chat").addEventListener("click", () => {
    handlers.startNew();
    closeSidebarOnPhone();
  });
  $("search").addEventListener("input", refreshList);
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("change", (event) => importFiles(event.target.files).then(() => (event.target.value = "")));
}

function matches(conversation, query) {
  if (!query) return true;
  const haystack = [conversation.title, ...conversation.messages.map((m) => m.content)].join("\n").toLowerCase();
  return haystack.includes(query);
}

export async function refreshList() {
  const query = $("search").value.trim().toLowerCase();
  const rows = (await allConversations()).filter((c) => matches(c, query));
  const open = handlers.current()?.id;
  $("conversations").replaceChildren(...rows.map((c) => row(c, c.id === open)));
}

function row(conversation, open) {
  const item = el("li", open ? "open" : "");
  const title = el("button", "title", conversation.title || "Untitled");
  title.type = "button";
  title.addEventListener("click", () => {
    handlers.open(conversation);
    refreshList();
    closeSidebarOnPhone();
  });
  const rename = el("button", "icon", "✎");
  rename.type = "button";
  rename.title = "Rename";
  rename.addEventListener("click", () => startRename(item, conversation));
  const remove = el("button", "icon", "×");
  remove.type = "button";
  remove.title = "Delete";
  remove.addEventListener("click", async () => {
    if (!remove.classList.contains("confirm")) {
      remove.classList.add("confirm");
      remove.textContent = "Delete?";
      return;
    }
    await deleteConversation(conversation.id);
    if (handlers.current()?.id === conversation.id) handlers.startNew();
    refreshList();
  });
  item.append(title, rename, remove);
  return item;
}

function startRename(item, conversation) {
  const input = el("input", "rename");
  input.value = conversation.title;
  input.setAttribute("aria-label", "Conversation title");
  const finish = async (keep) => {
    if (keep && input.value.trim()) {
      conversation.title = input.value.trim();
      if (handlers.current()?.id === conversation.id) handlers.current().title = conversation.title;
      await saveConversation(conversation);
    }
    refreshList();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true), { once: true });
  item.replaceChildren(input);
  input.focus();
  input.select();
}

async function exportAll() {
  const data = JSON.stringify({ conversations: await allConversations() }, null, 2);
  const link = el("a");
  link.href = URL.createObjectURL(new Blob([data], { type: "application/json" }));
  link.download = "localllm-conversations.json";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function importFiles(files) {
  try {
    for (const file of files) {
      const imported = parseImport(await file.text());
      for (const conversation of imported) await saveConversation(conversation);
      if (imported.length) handlers.open(imported[0]);
    }
    handlers.error("");
  } catch (error) {
    handlers.error(`import failed: ${error.message}`);
  }
  refreshList();
}

function closeSidebarOnPhone() {
  document.body.classList.remove("sidebar-open");
}
