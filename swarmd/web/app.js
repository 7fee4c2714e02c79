// The chat page every node serves at "/". Plain JS, no build step, no network beyond
// this node's own API. Chats live in localStorage; the address (#chat=<id>) names the
// open chat, so a reload or Back returns to it.
"use strict";

const $ = (sel) => document.querySelector(sel);
const STORE_CHATS = "swarmd.chats";
const STORE_SETTINGS = "swarmd.settings";
const DEFAULT_SETTINGS = { temperature: 0.7, maxTokens: 512, system: "", token: "" };

const state = {
  models: [],          // entries of /v1/models
  chats: loadJson(STORE_CHATS, {}),
  settings: { ...DEFAULT_SETTINGS, ...loadJson(STORE_SETTINGS, {}) },
  currentId: null,
  streaming: null,     // {controller, chatId}
  panel: null,
  holders: {},         // short id -> {peer_id, layers}
  timer: null,
  peers: {},           // peer id -> row of /api/peers (RTT, connected)
  selfId: "",          // this node's peer id
  peersNote: "",       // why peer details are missing ("" when /api/peers answered)
  swarmBusy: false,    // a Swarm refresh is in flight: the next tick skips
};

function loadJson(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value && typeof value === "object" ? value : fallback;
  } catch {
    return fallback;
  }
}

function saveChats() { localStorage.setItem(STORE_CHATS, JSON.stringify(state.chats)); }
function saveSettings() { localStorage.setItem(STORE_SETTINGS, JSON.stringify(state.settings)); }

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.settings.token) h.Authorization = `Bearer ${state.settings.token}`;
  return h;
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

// --- models ---------------------------------------------------------------------------

// Layers no holder covers, as [start, end) pairs: the holes in `coverage`.
function gapRanges(swarm) {
  const gaps = [];
  let at = 0;
  for (const [start, end] of swarm.coverage || []) {
    if (start > at) gaps.push([at, start]);
    at = Math.max(at, end);
  }
  if (at < swarm.num_layers) gaps.push([at, swarm.num_layers]);
  return gaps;
}

function missingRanges(swarm) {
  return gapRanges(swarm).map(([start, end]) => `${start}:${end}`);
}

function unroutableReason(entry) {
  const swarm = entry.swarm || {};
  if (swarm.routable !== false) return "";
  const gaps = missingRanges(swarm);
  return gaps.length ? `missing layers ${gaps.join(", ")}` : "some holders are banned or unreachable";
}

async function refreshModels() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      askToken(state.settings.token ? "That token was refused; enter another." : "");
      setStatus("error", "needs a token");
      return;
    }
    if (!response.ok) throw new Error(await errorText(response));
    $("#token-ask").hidden = true;
    state.models = (await response.json()).data || [];
  } catch (err) {
    setStatus("error", `cannot list models: ${err.message}`);
    return;
  }
  state.holders = {};
  for (const entry of state.models) {
    for (const h of (entry.swarm && entry.swarm.holders) || []) {
      state.holders[h.peer_id.slice(-8)] = h;
    }
  }
  renderModels();
  if (state.panel === "swarm") renderSwarm();
}

function renderModels() {
  const select = $("#model");
  const chosen = select.value || (currentChat() && currentChat().model) || "";
  select.textContent = "";
  for (const entry of state.models) {
    const reason = unroutableReason(entry);
    const option = document.createElement("option");
    option.value = entry.id;
    option.textContent = reason ? `${entry.id} (${reason})` : entry.id;
    option.disabled = Boolean(reason);
    option.title = reason || `${entry.id}: every layer is served`;
    select.appendChild(option);
  }
  const usable = state.models.filter((m) => !unroutableReason(m));
  const keep = usable.find((m) => m.id === chosen) || usable[0];
  if (keep) select.value = keep.id;
  else if (state.models.length) select.value = state.models[0].id;
  updateStatus();
}

function selectedModel() {
  return state.models.find((m) => m.id === $("#model").value);
}

function updateStatus() {
  const entry = selectedModel();
  if (!entry) return setStatus("error", "no model");
  const reason = unroutableReason(entry);
  if (reason) setStatus("incomplete", "incomplete", reason);
  else setStatus("ready", "ready");
}

function setStatus(kind, text, reason = "") {
  const el = $("#model-status");
  el.dataset.state = kind;
  el.textContent = text;
  $("#model-reason").textContent = reason;
  $("#send").disabled = kind !== "ready" && !state.streaming;
}

// --- chats ----------------------------------------------------------------------------

function currentChat() {
  return state.currentId ? state.chats[state.currentId] : null;
}

function openChat(id, push = true) {
  state.currentId = id && state.chats[id] ? id : null;
  const hash = state.currentId ? `#chat=${state.currentId}` : "#";
  if (push && location.hash !== hash) history.pushState(null, "", hash || "#");
  const chat = currentChat();
  if (chat && chat.model && state.models.some((m) => m.id === chat.model && !unroutableReason(m))) {
    $("#model").value = chat.model;
    updateStatus();
  }
  renderMessages();
  renderChatList();
}

function idFromHash() {
  const match = location.hash.match(/^#chat=([\w-]+)$/);
  return match ? match[1] : null;
}

function ensureChat(firstText) {
  let chat = currentChat();
  if (!chat) {
    const id = newId();
    chat = {
      id,
      title: firstText.trim().split("\n")[0].slice(0, 60) || "New chat",
      model: $("#model").value,
      created: Date.now(),
      updated: Date.now(),
      messages: [],
    };
    state.chats[id] = chat;
    openChat(id);
  }
  return chat;
}

function renderChatList() {
  const list = $("#chat-list");
  const query = $("#chat-search").value.trim().toLowerCase();
  list.textContent = "";
  const chats = Object.values(state.chats)
    .filter((c) => !query || c.title.toLowerCase().includes(query) ||
      c.messages.some((m) => (m.content || "").toLowerCase().includes(query)))
    .sort((a, b) => b.updated - a.updated);
  for (const chat of chats) {
    const li = document.createElement("li");
    li.className = "chat-item" + (chat.id === state.currentId ? " active" : "");
    li.dataset.id = chat.id;
    const open = document.createElement("button");
    open.type = "button";
    open.className = "chat-open";
    open.innerHTML = `<span class="chat-title"></span><span class="chat-meta"></span>`;
    open.querySelector(".chat-title").textContent = chat.title;
    open.querySelector(".chat-meta").textContent =
      `${chat.model || "-"} · ${new Date(chat.updated).toLocaleString()}`;
    open.addEventListener("click", () => { openChat(chat.id); closePanelOnPhone(); });
    const rename = smallButton("Rename", () => renameChat(li, chat));
    const remove = smallButton("Delete", () => deleteChat(chat));
    li.append(open, rename, remove);
    list.appendChild(li);
  }
  if (!chats.length) list.innerHTML = `<li class="hint">${query ? "No chat matches." : "No chats yet."}</li>`;
}

function smallButton(label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "small";
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

function renameChat(li, chat) {
  const input = document.createElement("input");
  input.className = "rename";
  input.value = chat.title;
  input.setAttribute("aria-label", "Chat title");
  li.replaceChildren(input);
  input.focus();
  input.select();
  const done = (keep) => {
    if (keep && input.value.trim()) {
      chat.title = input.value.trim().slice(0, 120);
      saveChats();
    }
    renderChatList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") done(true);
    if (e.key === "Escape") done(false);
  });
  input.addEventListener("blur", () => done(true));
}

function deleteChat(chat) {
  if (!confirm(`Delete the chat "${chat.title}"?`)) return;
  delete state.chats[chat.id];
  saveChats();
  if (state.currentId === chat.id) openChat(null);
  else renderChatList();
}

// --- messages -------------------------------------------------------------------------

function renderMessages() {
  const box = $("#messages");
  box.textContent = "";
  const chat = currentChat();
  if (!chat || !chat.messages.length) {
    box.innerHTML = '<p id="empty" class="empty">Ask anything. Enter sends, Shift+Enter starts a new line.</p>';
    return;
  }
  chat.messages.forEach((message, index) => box.appendChild(messageNode(chat, message, index)));
  box.scrollTop = box.scrollHeight;
}

function messageNode(chat, message, index) {
  const node = document.createElement("div");
  node.className = `msg ${message.role}`;
  node.dataset.index = index;
  const body = document.createElement("div");
  body.className = "body";
  if (message.role === "assistant") body.innerHTML = Markdown.render(message.content || "");
  else body.textContent = message.content;
  node.appendChild(body);
  if (message.role === "assistant") {
    if (message.error) {
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = message.error;
      node.appendChild(err);
    }
    if (message.stats) node.appendChild(speedLine(message));
    const actions = document.createElement("div");
    actions.className = "actions";
    const busy = Boolean(state.streaming);
    const last = index === chat.messages.length - 1;
    if (message.error && last) actions.appendChild(smallButton("Retry", () => regenerate(chat)));
    else if (last && !busy && !message.pending) actions.appendChild(smallButton("Regenerate", () => regenerate(chat)));
    if (message.content) actions.appendChild(smallButton("Copy", () => copyText(message.content)));
    node.appendChild(actions);
  } else if (message.role === "user" && !state.streaming) {
    const actions = document.createElement("div");
    actions.className = "actions";
    actions.appendChild(smallButton("Edit", () => editMessage(chat, index, node)));
    node.appendChild(actions);
  }
  return node;
}

function speedLine(message) {
  const s = message.stats;
  const line = document.createElement("div");
  line.className = "speed";
  const parts = [s.model];
  if (s.tokens != null) parts.push(`${s.tokens} tokens`);
  if (s.tokPerSec != null) parts.push(`${s.tokPerSec.toFixed(1)} tok/s`);
  if (s.ttftMs != null) parts.push(`TTFT ${Math.round(s.ttftMs)} ms`);
  if (s.stopped) parts.push("stopped");
  let route = "route: local";
  if (s.segments && s.segments.length) {
    const stages = s.segments.map((seg) => `${seg.node} [${seg.layers[0]}:${seg.layers[1]}] ${Math.round(seg.ms)} ms`);
    route = `route: ${s.route} (${s.segments.length} stage${s.segments.length > 1 ? "s" : ""}: ${stages.join(" → ")})`;
  }
  if (s.failovers) route += `, ${s.failovers} failover${s.failovers > 1 ? "s" : ""}`;
  parts.push(route);
  line.textContent = parts.join(" · ");
  return line;
}

function editMessage(chat, index, node) {
  const message = chat.messages[index];
  const editor = document.createElement("div");
  editor.className = "editor";
  const area = document.createElement("textarea");
  area.value = message.content;
  area.rows = Math.min(10, message.content.split("\n").length + 1);
  area.setAttribute("aria-label", "Edit message");
  editor.append(area, smallButton("Save and send", () => {
    if (!area.value.trim()) return;
    chat.messages = chat.messages.slice(0, index);
    chat.messages.push({ role: "user", content: area.value });
    saveChats();
    respond(chat);
  }), smallButton("Cancel", () => renderMessages()));
  node.replaceChildren(editor);
  area.focus();
}

function regenerate(chat) {
  if (state.streaming) return;
  while (chat.messages.length && chat.messages[chat.messages.length - 1].role === "assistant") {
    chat.messages.pop();
  }
  respond(chat);
}

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = document.createElement("textarea");
  area.value = text;
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
  return Promise.resolve();
}

// --- sending and streaming ------------------------------------------------------------

async function send(text) {
  if (!text.trim() || state.streaming) return;
  const chat = ensureChat(text);
  chat.messages.push({ role: "user", content: text });
  chat.updated = Date.now();
  saveChats();
  await respond(chat);
}

function apiMessages(chat) {
  const out = [];
  if (state.settings.system.trim()) out.push({ role: "system", content: state.settings.system });
  for (const m of chat.messages) {
    if (m.role === "assistant" && (m.error || m.pending)) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

async function respond(chat) {
  const model = $("#model").value;
  chat.model = model;
  const reply = { role: "assistant", content: "", pending: true };
  const history = apiMessages(chat);
  chat.messages.push(reply);
  chat.updated = Date.now();
  const controller = new AbortController();
  state.streaming = { controller, chatId: chat.id };
  setStreaming(true);
  renderMessages();
  const started = performance.now();
  let firstAt = null;
  try {
    const body = {
      model,
      messages: history,
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number(state.settings.temperature),
      max_tokens: Number(state.settings.maxTokens),
    };
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (response.status === 401) askToken("The node refused the token; enter a valid one.");
    if (!response.ok) throw new Error(await errorText(response));
    reply.stats = { model, route: response.headers.get("x-swarm-route") || "local" };
    await readStream(response, (event) => {
      if (event.error) throw new Error(event.error.message || "the node failed mid-reply");
      const delta = event.choices && event.choices[0] && event.choices[0].delta;
      if (delta && delta.content) {
        if (firstAt === null) firstAt = performance.now();
        reply.content += delta.content;
        updateLastMessage(chat);
      }
      if (event.usage) reply.stats.tokens = event.usage.completion_tokens;
      if (event.swarm) applySwarm(reply.stats, event.swarm);
    });
  } catch (err) {
    if (err.name === "AbortError") {
      reply.stats = reply.stats || { model };
      reply.stats.stopped = true;
    } else {
      reply.error = err.message;
    }
  } finally {
    delete reply.pending;
    if (reply.stats && reply.stats.ttftMs == null && firstAt !== null) {
      reply.stats.ttftMs = firstAt - started;  // a stopped reply: measured here
    }
    state.streaming = null;
    chat.updated = Date.now();
    saveChats();
    setStreaming(false);
    renderMessages();
    renderChatList();
    if (state.panel === "performance") renderPerformance();
  }
}

function applySwarm(stats, swarm) {
  const t = swarm.timing || {};
  stats.route = swarm.route;
  stats.segments = swarm.segments;
  stats.failovers = swarm.failovers;
  stats.ttftMs = t.ttft_ms;
  stats.decodeMs = t.decode_ms;
  if (stats.tokens > 1 && t.decode_ms > 0) stats.tokPerSec = (stats.tokens - 1) / (t.decode_ms / 1000);
  stats.at = Date.now();
}

async function readStream(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

function updateLastMessage(chat) {
  const nodes = $("#messages").querySelectorAll(".msg");
  const last = nodes[nodes.length - 1];
  const message = chat.messages[chat.messages.length - 1];
  if (!last || !message) return renderMessages();
  last.querySelector(".body").innerHTML = Markdown.render(message.content);
  const box = $("#messages");
  box.scrollTop = box.scrollHeight;
}

function setStreaming(on) {
  $("#send").hidden = on;
  $("#stop").hidden = !on;
  updateStatus();
}

// --- side column ----------------------------------------------------------------------

const PANEL_TITLES = { chats: "Chats", performance: "Performance", swarm: "Swarm", settings: "Settings" };

function showPanel(name) {
  state.panel = state.panel === name ? null : name;
  $("#side").hidden = !state.panel;
  for (const button of document.querySelectorAll("[data-panel]")) {
    button.setAttribute("aria-pressed", String(button.dataset.panel === state.panel));
  }
  for (const key of Object.keys(PANEL_TITLES)) $(`#panel-${key}`).hidden = key !== state.panel;
  $("#side-title").textContent = state.panel ? PANEL_TITLES[state.panel] : "";
  clearInterval(state.timer);
  state.timer = null;
  if (state.panel === "chats") renderChatList();
  if (state.panel === "settings") renderSettings();
  if (state.panel === "performance") {
    renderPerformance();
    // Refreshed while open: holders (for the peer ids) and the charts.
    state.timer = setInterval(async () => { await refreshModels(); renderPerformance(); }, 3000);
  }
  if (state.panel === "swarm") {
    renderSwarm();
    refreshSwarm();
    state.timer = setInterval(refreshSwarm, SWARM_REFRESH_MS);
  }
}

function closePanelOnPhone() {
  if (window.matchMedia("(max-width: 760px)").matches && state.panel) showPanel(state.panel);
}

function lastStats() {
  const all = Object.values(state.chats).flatMap((c) => c.messages.filter((m) => m.stats && m.stats.at));
  return all.sort((a, b) => a.stats.at - b.stats.at).map((m) => m.stats);
}

function renderPerformance() {
  const stats = lastStats();
  const last = stats[stats.length - 1];
  const cards = $("#route-cards");
  cards.textContent = "";
  if (!last) {
    cards.innerHTML = '<p class="hint">No reply yet.</p>';
    $("#link-time").textContent = "";
  } else {
    const segments = last.segments || [];
    const tokens = Math.max(1, last.tokens || 1);
    for (const [i, seg] of segments.entries()) {
      const holder = state.holders[seg.node];
      const card = document.createElement("div");
      card.className = "stage-card";
      card.innerHTML = `<div class="stage-title"></div><div class="stage-peer"></div><div class="stage-ms"></div>`;
      card.querySelector(".stage-title").textContent = `Stage ${i + 1}: layers ${seg.layers[0]}:${seg.layers[1]}`;
      card.querySelector(".stage-peer").textContent = holder ? holder.peer_id : seg.node;
      card.querySelector(".stage-ms").textContent =
        `${(seg.ms / tokens).toFixed(1)} ms per token (${Math.round(seg.ms)} ms in all)`;
      cards.appendChild(card);
    }
    const computeMs = segments.reduce((sum, seg) => sum + seg.ms, 0);
    if (last.tokens > 1 && last.decodeMs) {
      const perToken = last.decodeMs / (last.tokens - 1);
      const hops = last.route === "distributed" ? segments.length : 0;
      const linkMs = hops ? Math.max(0, perToken - computeMs / tokens) / hops : 0;
      $("#link-time").textContent = hops
        ? `Links: about ${linkMs.toFixed(1)} ms per hop between stages (${perToken.toFixed(1)} ms per token, ${(computeMs / tokens).toFixed(1)} ms of it computing, ${hops} hops in the ring)`
        : `Local: ${perToken.toFixed(1)} ms per token, no links between stages`;
    } else {
      $("#link-time").textContent = "";
    }
  }
  renderChart(stats.slice(-20).map((s) => s.tokPerSec || 0));
  const entry = selectedModel();
  $("#swarm-line").textContent = entry && entry.swarm
    ? `${entry.swarm.holders.length} holder(s) of ${entry.id}; ${entry.swarm.complete ? "every layer is served" : "layers are missing"}`
    : "";
}

function renderChart(values) {
  const svg = $("#speed-chart");
  svg.textContent = "";
  if (!values.length) return;
  const max = Math.max(...values, 1);
  const width = 300 / values.length;
  values.forEach((v, i) => {
    const h = (v / max) * 84;
    const bar = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    bar.setAttribute("x", String(i * width + 1));
    bar.setAttribute("y", String(96 - h));
    bar.setAttribute("width", String(Math.max(1, width - 2)));
    bar.setAttribute("height", String(h));
    bar.setAttribute("class", "bar");
    const title = document.createElementNS("http://www.w3.org/2000/svg", "title");
    title.textContent = `${v.toFixed(1)} tok/s`;
    bar.appendChild(title);
    svg.appendChild(bar);
  });
  const label = document.createElementNS("http://www.w3.org/2000/svg", "text");
  label.setAttribute("x", "2");
  label.setAttribute("y", "10");
  label.setAttribute("class", "axis");
  label.textContent = `max ${max.toFixed(1)} tok/s`;
  svg.appendChild(label);
}

// --- the swarm view -------------------------------------------------------------------
// One card per model of /v1/models: a lane per holder over layers [0, num_layers), its
// range drawn in the peer's own colour, and a lane of the gaps in red. Every colour has
// its text beside it (short ids, ranges, "gap a:b"), so the view reads without colour.

const SWARM_REFRESH_MS = 3000;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text != null) node.textContent = text;
  return node;
}

// A stable hue per peer id (FNV-1a), so a peer keeps its colour across models and reloads.
function peerHue(peerId) {
  let hash = 0x811c9dc5;
  for (let i = 0; i < peerId.length; i++) {
    hash ^= peerId.charCodeAt(i);
    hash = Math.imul(hash, 0x01000193) >>> 0;
  }
  return hash % 360;
}

// RTTs come from /api/peers, an admin-scope endpoint: without it the layers still show.
async function refreshPeers() {
  try {
    const response = await fetch("/api/peers", { headers: headers() });
    if (response.status === 401 || response.status === 403) {
      state.peers = {};
      state.peersNote = "RTTs need an admin-scope token (swarmd token create --scope admin); the layers below are shown without one.";
      return;
    }
    if (!response.ok) throw new Error(await errorText(response));
    const body = await response.json();
    state.selfId = body.peer_id || state.selfId;
    state.peers = Object.fromEntries((body.peers || []).map((row) => [row.peer_id, row]));
    state.peersNote = "";
  } catch (err) {
    state.peers = {};
    state.peersNote = `No peer details: ${err.message}`;
  }
}

async function refreshSelfId() {
  if (state.selfId) return;
  try {
    const response = await fetch("/health");  // open: names this node even without a token
    if (response.ok) state.selfId = (await response.json()).peer_id || "";
  } catch { /* shown without the "this node" mark */ }
}

async function refreshSwarm() {
  if (state.swarmBusy) return;  // a slow DHT lookup must not pile up requests
  state.swarmBusy = true;
  try {
    await Promise.all([refreshPeers(), refreshModels(), refreshSelfId()]);
  } finally {
    state.swarmBusy = false;
  }
  if (state.panel === "swarm") renderSwarm();
}

// What is known of one holder, as text: RTT, connection, speed when the node reports one.
function holderFacts(modelId, holder) {
  if (holder.peer_id === state.selfId) return { short: "this node", detail: "this node" };
  const row = state.peers[holder.peer_id];
  const facts = [];
  let short = "";
  if (row) {
    if (row.rtt_ms != null) {
      short = `${Math.round(row.rtt_ms)} ms`;
      facts.push(`RTT ${Number(row.rtt_ms).toFixed(1)} ms`);
    } else {
      facts.push("RTT not measured yet");
    }
    if (row.connected === false) facts.push("not connected");
    if (row.failures) facts.push(`${row.failures} failure${row.failures > 1 ? "s" : ""}`);
    const serves = (row.serves || []).find((s) => s.model === modelId) || {};
    const tps = serves.throughput_tps ?? row.throughput_tps;
    if (tps != null) facts.push(`${Number(tps).toFixed(1)} tok/s`);
  } else {
    facts.push(state.peersNote ? "RTT unavailable" : "RTT unknown");
  }
  return { short, detail: facts.join(" · ") };
}

function laneNode(label, title) {
  const lane = el("div", "lane");
  lane.setAttribute("role", "listitem");
  lane.title = title;
  lane.append(el("span", "lane-label", label), el("div", "track"));
  return lane;
}

function segmentNode(start, end, numLayers, text) {
  const seg = el("span", "seg", text);
  seg.style.left = `${(start / numLayers) * 100}%`;
  seg.style.width = `${((end - start) / numLayers) * 100}%`;
  return seg;
}

function swarmCard(entry) {
  const swarm = entry.swarm || {};
  const numLayers = Math.max(1, swarm.num_layers || 1);
  const holders = [...(swarm.holders || [])].sort(
    (a, b) => a.layers[0] - b.layers[0] || a.layers[1] - b.layers[1] || a.peer_id.localeCompare(b.peer_id));
  const gaps = gapRanges(swarm);
  const reason = unroutableReason(entry);
  const card = el("section", "swarm-model");
  card.dataset.model = entry.id;
  card.setAttribute("aria-label", `Model ${entry.id}`);
  const head = el("div", "swarm-head");
  const badge = el("span", "badge", reason ? "not routable" : "routable");
  badge.dataset.routable = String(!reason);
  if (reason) badge.title = reason;
  head.append(el("span", "swarm-id", entry.id), badge);
  const parts = [`${swarm.num_layers ?? "?"} layers`, `${holders.length} holder${holders.length === 1 ? "" : "s"}`];
  parts.push(gaps.length ? gaps.map(([a, b]) => `gap ${a}:${b}`).join(", ") : "every layer is served");
  if (reason && !gaps.length) parts.push(reason);
  const summary = el("p", "swarm-summary", parts.join(" · "));
  const lanes = el("div", "lanes");
  lanes.setAttribute("role", "list");
  for (const holder of holders) {
    const [start, end] = holder.layers;
    const shortId = holder.peer_id.slice(-8);
    const facts = holderFacts(entry.id, holder);
    const lane = laneNode(shortId, `${shortId} · layers ${start}:${end} · ${facts.detail}`);
    lane.classList.add("holder");
    lane.dataset.peer = holder.peer_id;
    const seg = segmentNode(start, end, numLayers, `${start}:${end}`);
    const hue = peerHue(holder.peer_id);
    seg.style.background = `hsl(${hue} 65% 82%)`;
    seg.style.borderColor = `hsl(${hue} 50% 42%)`;
    lane.querySelector(".track").appendChild(seg);
    lane.appendChild(el("span", "lane-rtt", facts.short));
    lanes.appendChild(lane);
  }
  const gapLane = laneNode("gaps", gaps.length
    ? `layers no holder serves: ${gaps.map(([a, b]) => `${a}:${b}`).join(", ")}`
    : "no gaps: every layer has a holder");
  gapLane.classList.add("gaps");
  for (const [start, end] of gaps) {
    const seg = segmentNode(start, end, numLayers, `gap ${start}:${end}`);
    seg.classList.add("gap");
    gapLane.querySelector(".track").appendChild(seg);
  }
  gapLane.appendChild(el("span", "lane-rtt", gaps.length ? "" : "none"));
  lanes.appendChild(gapLane);
  const axis = el("div", "swarm-axis");
  axis.setAttribute("aria-hidden", "true");
  axis.append(el("span", "", "layer 0"), el("span", "", String(swarm.num_layers ?? "?")));
  card.append(head, summary, lanes, axis);
  return card;
}

function renderSwarm() {
  $("#swarm-note").textContent = state.peersNote;
  const box = $("#swarm-models");
  box.textContent = "";
  if (!state.models.length) box.appendChild(el("p", "hint", "No model listed yet."));
  for (const entry of state.models) box.appendChild(swarmCard(entry));
}

function renderSettings() {
  const s = state.settings;
  $("#set-temperature").value = s.temperature;
  $("#set-max-tokens").value = s.maxTokens;
  $("#set-system").value = s.system;
  $("#set-token").value = s.token;
  const base = `${location.origin}/v1`;
  $("#api-base").textContent = base;
  const model = $("#model").value || "MODEL";
  const auth = s.token ? ` -H "Authorization: Bearer $SWARMD_TOKEN"` : "";
  const examples = {
    curl: `curl ${base}/chat/completions -H "Content-Type: application/json"${auth} \\\n  -d '{"model": "${model}", "messages": [{"role": "user", "content": "Hello"}]}'`,
    Python: `from openai import OpenAI\n\nclient = OpenAI(base_url="${base}", api_key="${s.token ? "sk-swarm-..." : "none"}")\nreply = client.chat.completions.create(\n    model="${model}",\n    messages=[{"role": "user", "content": "Hello"}],\n)\nprint(reply.choices[0].message.content)`,
    JavaScript: `const response = await fetch("${base}/chat/completions", {\n  method: "POST",\n  headers: {"Content-Type": "application/json"${s.token ? ', "Authorization": "Bearer sk-swarm-..."' : ""}},\n  body: JSON.stringify({model: "${model}", messages: [{role: "user", content: "Hello"}]}),\n});\nconsole.log((await response.json()).choices[0].message.content);`,
  };
  const box = $("#examples");
  box.textContent = "";
  for (const [name, code] of Object.entries(examples)) {
    const wrap = document.createElement("div");
    wrap.className = "code";
    wrap.innerHTML = `<span class="lang"></span><button type="button" class="copy-code">Copy</button><pre><code></code></pre>`;
    wrap.querySelector(".lang").textContent = name;
    wrap.querySelector("code").textContent = code;
    box.appendChild(wrap);
  }
}

function bindSettings() {
  const bind = (sel, key, parse) => $(sel).addEventListener("change", (e) => {
    state.settings[key] = parse(e.target.value);
    saveSettings();
    if (key === "token") refreshModels();
    renderSettings();
  });
  bind("#set-temperature", "temperature", (v) => Math.min(2, Math.max(0, Number(v) || 0)));
  bind("#set-max-tokens", "maxTokens", (v) => Math.max(1, Math.round(Number(v) || 1)));
  bind("#set-system", "system", (v) => v);
  bind("#set-token", "token", (v) => v.trim());
}

// The node answered 401: ask for a token (kept in this browser's localStorage only).
function askToken(why) {
  const form = $("#token-ask");
  $("#token-why").textContent = why || "This node needs an API token.";
  if (form.hidden) {
    form.hidden = false;
    $("#token-input").focus();
  }
}

function saveToken(e) {
  e.preventDefault();
  const token = $("#token-input").value.trim();
  if (!token) return;
  state.settings.token = token;
  saveSettings();
  $("#token-input").value = "";
  renderSettings();
  refreshModels();
}

// --- wiring ---------------------------------------------------------------------------

function init() {
  $("#composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("#prompt").value;
    if (!text.trim() || $("#send").disabled) return;
    $("#prompt").value = "";
    send(text);
  });
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", () => state.streaming && state.streaming.controller.abort());
  $("#new-chat").addEventListener("click", () => { openChat(null); $("#prompt").focus(); });
  $("#model").addEventListener("change", updateStatus);
  for (const button of document.querySelectorAll("[data-panel]")) {
    button.addEventListener("click", () => showPanel(button.dataset.panel));
  }
  $("#side-close").addEventListener("click", () => state.panel && showPanel(state.panel));
  $("#chat-search").addEventListener("input", renderChatList);
  document.addEventListener("click", (e) => {
    const button = e.target.closest(".copy-code");
    if (!button) return;
    copyText(button.parentElement.querySelector("code").textContent).then(() => {
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
  });
  window.addEventListener("popstate", () => openChat(idFromHash(), false));
  bindSettings();
  $("#token-ask").addEventListener("submit", saveToken);
  refreshModels().then(() => openChat(idFromHash(), false));
  setInterval(refreshModels, 15000);
}

init();
