// The console's shell: which view shows (from the URL's #hash), the API-key dialog, and one poll of
// GET /v1/engine/state a second that feeds the live view and the KV-cache map while either is open.

import { apiKey, getJSON, setApiKey, unauthorized } from "./api.js";
import { KVMapView } from "./kvmap.js";
import { LiveView } from "./live.js";
import { Playground } from "./playground.js";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);

const playground = new Playground($("view-playground"));
const views = {
  playground: { element: $("view-playground"), polls: false },
  live: { element: $("view-live"), polls: true, view: new LiveView($("view-live")) },
  kv: { element: $("view-kv"), polls: true, view: new KVMapView($("view-kv")) },
};
let current = null;
let pollTimer = null;
let pollRun = 0; // a new run (view change, key entered) ends the old one, so two loops never overlap

function showView() {
  const name = location.hash.slice(1) in views ? location.hash.slice(1) : "playground";
  current = views[name];
  for (const [viewName, view] of Object.entries(views)) view.element.hidden = viewName !== name;
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("active", link.dataset.view === name);
  }
  startPolling();
}

function startPolling() {
  clearTimeout(pollTimer);
  pollRun += 1;
  if (current.polls) poll(pollRun);
}

async function poll(run) {
  try {
    const state = await getJSON("/v1/engine/state");
    if (run !== pollRun) return;
    current.view.update(state);
    setStatus(`updated ${new Date(state.taken_at * 1000).toLocaleTimeString()}`, false);
  } catch (error) {
    if (run !== pollRun) return;
    setStatus(error.status ? error.message : "server unreachable", true);
    if (error.status === 401) return; // resumes once a key is entered
  }
  pollTimer = setTimeout(() => poll(run), POLL_MS);
}

function setStatus(text, isError) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

async function loadModels() {
  try {
    const models = await getJSON("/v1/models");
    const ids = models.data.map((model) => model.id);
    playground.setModels(ids);
    $("model-name").textContent = ids.join(", ");
    setStatus("connected", false);
  } catch (error) {
    setStatus(error.message, true);
  }
}

function askForKey() {
  $("key-error").textContent = apiKey() ? "That key was refused." : "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("key-input").focus();
}

unauthorized.addEventListener("unauthorized", askForKey);
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey($("key-input").value.trim());
  $("key-input").value = "";
  $("key-dialog").close();
  $("forget-key").hidden = !apiKey();
  loadModels();
  startPolling();
});
$("forget-key").addEventListener("click", () => {
  setApiKey(null);
  location.reload();
});
$("forget-key").hidden = !apiKey();
window.addEventListener("hashchange", showView);

showView();
loadModels();
