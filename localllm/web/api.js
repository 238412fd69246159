// The server's public API, as the page calls it: the key (asked once, kept for the session), errors in the server's
// own words, and NDJSON streams read line by line.

const KEY_ITEM = "localllm.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let keyPrompt = null; // one dialog at a time, however many calls answered 401 together
let keyWasAsked = false;

export function keyRequired() {
  return keyWasAsked || sessionStorage.getItem(KEY_ITEM) !== null;
}

function askForKey(wrong) {
  if (keyPrompt) return keyPrompt;
  const dialog = document.getElementById("key-dialog");
  const form = dialog.querySelector("form");
  const input = dialog.querySelector("input");
  dialog.querySelector(".wrong").hidden = !wrong;
  input.value = "";
  keyWasAsked = true;
  keyPrompt = new Promise((resolve) => {
    form.addEventListener(
      "submit",
      (event) => {
        event.preventDefault();
        sessionStorage.setItem(KEY_ITEM, input.value.trim());
        dialog.close();
        keyPrompt = null;
        resolve();
      },
      { once: true },
    );
  });
  dialog.showModal();
  input.focus();
  return keyPrompt;
}

function headers(body) {
  const result = {};
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) result.Authorization = `Bearer ${key}`;
  if (body !== undefined) result["Content-Type"] = "application/json";
  return result;
}

async function errorOf(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const error = body.error;
    return new ApiError(response.status, typeof error === "string" ? error : error?.message || text);
  } catch {
    return new ApiError(response.status, text || `${response.status} ${response.statusText}`);
  }
}

// fetch(path) with the key; a 401 asks for the key and tries again. Any other error status throws ApiError.
export async function call(path, { method = "GET", body, signal } = {}) {
  for (;;) {
    const init = { method, headers: headers(body), signal };
    if (body !== undefined) init.body = JSON.stringify(body);
    const response = await fetch(path, init);
    if (response.status === 401) {
      await askForKey(sessionStorage.getItem(KEY_ITEM) !== null);
      continue;
    }
    if (!response.ok) throw await errorOf(response);
    return response;
  }
}

export async function getJson(path, options) {
  return (await call(path, options)).json();
}

// The objects of an NDJSON body as they arrive. A line carrying {"error": ...} (an error after the stream began)
// throws, as a status would have.
export async function* ndjson(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const lines = pending.split("\n");
    pending = lines.pop();
    for (const line of lines) {
      if (line.trim()) yield parseLine(line);
    }
  }
  if (pending.trim()) yield parseLine(pending);
}

function parseLine(line) {
  const value = JSON.parse(line);
  if (value.error) throw new ApiError(200, value.error);
  return value;
}
