// The page's entry: views (#chat, #models), the keyboard, and what the page says about how it is reached.

import { keyRequired } from "./api.js";
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

// A page opened by another machine's address is served to the network: say so, and whether a key guards it.
function showReach() {
  const reach = $("reach");
  if (LOOPBACK.test(location.hostname)) return;
  reach.hidden = false;
  reach.textContent = keyRequired()
    ? `reachable from other machines at ${location.host}, guarded by an API key`
    : `reachable from other machines at ${location.host} with no API key: set LOCALLLM_API_KEY`;
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
  showReach();
  startEngineFigures();
  document.body.dataset.ready = "true";
}

start();
