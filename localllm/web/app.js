// The page's entry: views (#chat, #models), the keyboard, and what the page says about how it is reached.

import { getJson, keyRequired } from "./api.js";
import * as chat from "./chat.js";
import { initConversations, refreshList } from "./conversations.js";
import { startEngineFigures } from "./engine.js";
import { initModels, refreshModels } from "./models.js";
import { allConversations, saveConversation } from "./store.js";

const $ = (id) => document.getElementById(id);
const LOOPBACK = /^(localhost|127\.\d+\.\d+\.\d+|\[::1\])$/;

function showView() {
  const view = location.hash === "#models" ? "models" : "chat";
  $("chat-view").hidden = view !== "chat";
  $("models-view").hidden = view !== "models";
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.view === view);
  if (view === "models") refreshModels().catch((error) => ($("pull-status").textContent = error.message));
}

// A server other machines can reach (the page opened by another machine's address, or /health saying it listens
// beyond loopback): say so, and whether a key guards it.
async function showReach() {
  const reach = $("reach");
  const health = await getJson("/health").catch(() => ({}));
  if (LOOPBACK.test(location.hostname) && !health.network) return;
  const where = LOOPBACK.test(location.hostname) ? "beyond this machine" : `at ${location.host}`;
  reach.hidden = false;
  reach.textContent = keyRequired()
    ? `reachable from other machines ${where}, guarded by an API key`
    : `reachable from other machines ${where} with no API key: set LOCALLLM_API_KEY`;
  reach.classList.toggle("warn", !keyRequired());
}

// Answers left streaming when the page went away (a reload, a closed tab) are kept and marked.
async function markInterrupted(conversations) {
  for (const conversation of conversations) {
    const left = conversation.messages.filter((m) => m.streaming);
    for (const message of left) {
      delete message.streaming;
      message.partial = "cut off: the page was closed or reloaded while it streamed";
    }
    if (left.length) await saveConversation(conversation);
  }
}

async function start() {
  chat.initChat({ onListChange: () => refreshList() });
  initConversations({
    open: chat.openConversation,
    current: chat.current,
    startNew: chat.startConversation,
    error: chat.showError,
  });
  initModels({ onChange: () => chat.loadModels() });
  $("menu-toggle").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  window.addEventListener("hashchange", showView);
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && chat.isStreaming()) chat.stop();
  });
  try {
    await chat.loadModels();
  } catch (error) {
    chat.showError(`the server did not answer: ${error.message}`);
  }
  const conversations = await allConversations();
  await markInterrupted(conversations);
  if (conversations.length) chat.openConversation(conversations[0]);
  else chat.startConversation();
  await refreshList();
  showView();
  await showReach();
  startEngineFigures();
  document.body.dataset.ready = "true";
}

start();
