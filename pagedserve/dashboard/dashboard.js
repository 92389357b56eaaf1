// pagedserve's KV-cache dashboard. Live: reads /v1/kv/stream (server-sent events, read with fetch so
// that the API key goes in a header) - a "snapshot" event with the whole picture, then "update"
// events with the blocks that changed. Replay: the same events, embedded in the file by
// `pagedserve generate --kv-map run.html` (window.PAGEDSERVE_REPLAY), played frame by frame.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const KEY_NAME = "pagedserve_api_key";
  const HISTORY = 240;                 // points kept for the charts
  let page = null;                     // the whole picture (snapshot with updates applied)
  let selectedRequest = null;          // request id
  let focusBlock = null;               // {pool, id} shown in the detail panel
  let history = [];                    // {time, counters, contiguous}
  const cells = { device: [], host: [] };

  // ---- the picture ------------------------------------------------------------------------------
  function applySnapshot(s) {
    page = s;
    buildMap("device", $("block-map"), s.blocks);
    buildMap("host", $("host-map"), s.host_blocks);
    $("host-panel").hidden = s.host_blocks.length === 0;
    refresh();
  }

  function applyUpdate(u) {
    for (const [pool, name] of [["device", "blocks"], ["host", "host_blocks"]]) {
      for (const b of u[name]) {
        page[name][b.id] = b;
        paint(cells[pool][b.id], b);
      }
    }
    for (const k of Object.keys(u)) if (k !== "blocks" && k !== "host_blocks") page[k] = u[k];
    refresh();
  }

  function refresh() {
    history.push({ time: page.time, counters: page.counters, contiguous: page.contiguous });
    if (history.length > HISTORY) history = history.slice(-HISTORY);
    renderCounters();
    renderRequests();
    renderTables();
    renderDetail();
    renderCharts();
  }

  // ---- block maps -------------------------------------------------------------------------------
  function buildMap(pool, container, blocks) {
    container.textContent = "";
    cells[pool] = blocks.map((b) => {
      const cell = document.createElement("div");
      cell.className = "cell";
      cell.dataset.blockId = b.id;
      cell.dataset.pool = pool;
      paint(cell, b);
      cell.addEventListener("mouseenter", () => { focusBlock = { pool, id: b.id }; renderDetail(); });
      cell.addEventListener("click", () => {
        focusBlock = { pool, id: b.id };
        const owners = blockOf(focusBlock).owners;
        if (owners.length) selectedRequest = owners[0];
        renderRequests(); renderTables(); renderDetail();
      });
      container.appendChild(cell);
      return cell;
    });
  }

  function paint(cell, b) {
    cell.dataset.state = b.state;
    cell.dataset.refCnt = b.ref_cnt;
    cell.classList.toggle("in-cache", !!b.hash && b.state !== "cached");
  }

  function blockOf(ref) {
    return (ref.pool === "host" ? page.host_blocks : page.blocks)[ref.id];
  }

  // ---- counters and charts ----------------------------------------------------------------------
  // Rates and means over the last few seconds, from the running totals of two points in history.
  function windowed(seconds) {
    const last = history[history.length - 1];
    let first = last;
    for (let i = history.length - 1; i >= 0 && last.time - history[i].time <= seconds; i--) first = history[i];
    return [first, last];
  }

  function rate(first, last, name) {
    const dt = last.time - first.time;
    const a = first.counters[name], b = last.counters[name];
    return dt > 0 && a !== undefined && b !== undefined ? (b - a) / dt : null;
  }

  function mean(first, last, sum, count) {
    const n = (last.counters[count] ?? 0) - (first.counters[count] ?? 0);
    if (n > 0) return (last.counters[sum] - first.counters[sum]) / n;
    const total = last.counters[count];
    return total ? last.counters[sum] / total : null;   // nothing new: the mean so far
  }

  function fmt(v, digits = 1, unit = "") {
    return v === null || v === undefined || Number.isNaN(v) ? "-" : v.toFixed(digits) + unit;
  }

  function renderCounters() {
    const c = page.counters, k = page.contiguous;
    const [first, last] = windowed(5);
    const pct = (x) => fmt(100 * x, 1, "%");
    const items = [
      ["kv_cache_usage", "KV usage", c.usage, pct(c.usage) + ` (${c.num_used_blocks}/${c.num_blocks})`],
      ["num_cached_blocks", "cached blocks", c.num_cached_blocks, String(c.num_cached_blocks)],
      ["prefix_cache_hit_rate", "prefix-cache hit rate", c.prefix_cache_hit_rate, pct(c.prefix_cache_hit_rate)],
      ["sharing_saving", "saved by sharing", c.sharing_saving, pct(c.sharing_saving)],
      ["num_running", "running", c.num_running, String(c.num_running)],
      ["num_waiting", "waiting", c.num_waiting, String(c.num_waiting)],
      ["num_swapped", "swapped", c.num_swapped, String(c.num_swapped)],
      ["num_preemptions", "preemptions", c.num_preemptions, String(c.num_preemptions)],
      ["prompt_tokens", "prompt tokens", c.prompt_tokens, c.prompt_tokens ?? "-"],
      ["generation_tokens", "generated tokens", c.generation_tokens, c.generation_tokens ?? "-"],
      ["prompt_tps", "prompt tokens/s", rate(first, last, "prompt_tokens"), fmt(rate(first, last, "prompt_tokens"))],
      ["generation_tps", "generation tokens/s", rate(first, last, "generation_tokens"),
        fmt(rate(first, last, "generation_tokens"))],
      ["ttft", "time to first token", mean(first, last, "ttft_sum", "ttft_count"),
        fmt(1000 * mean(first, last, "ttft_sum", "ttft_count"), 0, " ms")],
      ["itl", "inter-token latency", mean(first, last, "itl_sum", "itl_count"),
        fmt(1000 * mean(first, last, "itl_sum", "itl_count"), 0, " ms")],
      ["paged_blocks", "paging holds", k.paged_blocks, `${k.paged_blocks} blocks`],
      ["orca_oracle_blocks", "Orca-Oracle would hold", k.orca_oracle_blocks, `${k.orca_oracle_blocks} blocks`],
      ["orca_max_blocks", "Orca-Max would hold", k.orca_max_blocks, `${k.orca_max_blocks} blocks`],
      // The disk tier below the prefix cache (only with --kv-offload-path).
      ["kv_offload_blocks", "disk tier", c.kv_offload_blocks,
        `${c.kv_offload_blocks} blocks, ${c.kv_offload_blocks_loaded} read back`],
      ["kv_offload_hit_rate", "disk-tier hit rate", c.kv_offload_queries,
        pct(c.kv_offload_queries ? c.kv_offload_hits / c.kv_offload_queries : 0)],
      ["kv_offload_bytes", "disk-tier MiB written / read", c.kv_offload_bytes_written,
        `${fmt(c.kv_offload_bytes_written / 2 ** 20, 1)} / ${fmt(c.kv_offload_bytes_read / 2 ** 20, 1)}`],
    ];
    const box = $("counters");
    box.textContent = "";
    for (const [name, label, value, text] of items) {
      if (value === undefined) continue;   // not reported here (e.g. token totals in an offline replay)
      const div = document.createElement("div");
      div.className = "counter";
      div.dataset.counter = name;
      div.dataset.value = value === null ? "" : value;
      div.innerHTML = '<div class="label"></div><div class="value"></div>';
      div.firstChild.textContent = label;
      div.lastChild.textContent = text;
      box.appendChild(div);
    }
    const kvDtype = page.counters.kv_cache_dtype ? `, KV ${page.counters.kv_cache_dtype} ` +
      `(${page.counters.kv_bytes_per_token} bytes/token)` : "";
    $("block-summary").textContent = `${page.num_blocks} blocks of ${page.block_size} tokens, ` +
      `allocator ${page.kv_allocator}${kvDtype}, step ${page.step}`;
  }

  const CHARTS = [
    ["KV usage (%)", [["usage", (p) => 100 * p.counters.usage, "#3b7ddd"]]],
    ["prefix-cache hit rate (%)", [["hit rate", (p) => 100 * p.counters.prefix_cache_hit_rate, "#7cc47c"]]],
    ["tokens/s", [["prompt", (p, q) => q && rate(q, p, "prompt_tokens"), "#8e44ad"],
                  ["generation", (p, q) => q && rate(q, p, "generation_tokens"), "#e67e22"]]],
    ["TTFT and inter-token latency (ms)", [
      ["TTFT", (p, q) => q && 1000 * mean(q, p, "ttft_sum", "ttft_count"), "#c0392b"],
      ["ITL", (p, q) => q && 1000 * mean(q, p, "itl_sum", "itl_count"), "#16a085"]]],
    ["preemptions", [["preemptions", (p) => p.counters.num_preemptions, "#b03a2e"]]],
    ["blocks needed for the running requests", [
      ["paging", (p) => p.contiguous.paged_blocks, "#3b7ddd"],
      ["Orca-Oracle", (p) => p.contiguous.orca_oracle_blocks, "#f0a020"],
      ["Orca-Max", (p) => p.contiguous.orca_max_blocks, "#b03a2e"],
      ["capacity", (p) => p.counters.num_blocks, "#999999"]]],
  ];

  function renderCharts() {
    const box = $("charts");
    if (!box.children.length) {
      for (const [title, series] of CHARTS) {
        const div = document.createElement("div");
        div.className = "chart";
        div.innerHTML = "<h3></h3><canvas></canvas>";
        div.firstChild.textContent = title + ": " + series.map((s) => s[0]).join(", ");
        box.appendChild(div);
      }
    }
    CHARTS.forEach(([, series], i) => drawChart(box.children[i].lastChild, series));
  }

  function drawChart(canvas, series) {
    const w = canvas.clientWidth, h = canvas.clientHeight, ratio = window.devicePixelRatio || 1;
    if (canvas.width !== w * ratio) { canvas.width = w * ratio; canvas.height = h * ratio; }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    if (history.length < 2) return;
    const t0 = history[0].time, t1 = history[history.length - 1].time || t0 + 1;
    const lines = series.map(([, f]) => history.map((p, i) => {
      const [q] = i ? [history[Math.max(0, i - 4)]] : [null];
      const v = f(p, q);
      return v === null || v === undefined || Number.isNaN(v) ? null : v;
    }));
    const top = Math.max(1e-9, ...lines.flat().filter((v) => v !== null));
    ctx.font = "10px sans-serif";
    ctx.fillStyle = "#6b7480";
    ctx.fillText(top > 1e-9 ? top.toPrecision(3) : "0", 2, 10);
    series.forEach(([name, , color], s) => {
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      lines[s].forEach((v, i) => {
        if (v === null) return;
        const x = (w - 2) * (history[i].time - t0) / Math.max(1e-9, t1 - t0) + 1;
        const y = h - 2 - (h - 14) * v / top;
        if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
      });
      ctx.stroke();
      ctx.fillStyle = color;
      ctx.fillText(name, w - 80, 10 + 11 * s);
    });
  }

  // ---- requests and their block tables ----------------------------------------------------------
  function renderRequests() {
    const box = $("requests");
    box.textContent = "";
    for (const status of ["running", "swapped", "waiting"]) {
      const reqs = page.requests.filter((r) => r.status === status);
      const div = document.createElement("div");
      div.className = "queue";
      div.dataset.queue = status;
      const title = document.createElement("div");
      title.className = "sub";
      title.textContent = `${status} (${reqs.length})`;
      div.appendChild(title);
      for (const r of reqs) {
        const chip = document.createElement("span");
        chip.className = "req" + (r.id === selectedRequest ? " selected" : "");
        chip.dataset.requestId = r.id;
        chip.textContent = shortId(r.id) + (r.seqs.length > 1 ? ` x${r.seqs.filter((s) => !s.finished).length}` : "") +
          (r.lora ? ` [${r.lora}]` : "");
        chip.title = `${r.id}: ${r.kind}, n=${r.n}, prompt ${r.num_prompt_tokens} tokens (${r.num_cached_tokens} cached), ` +
          `max_tokens ${r.max_tokens}, preempted ${r.num_preemptions}x` + (r.lora ? `, LoRA adapter ${r.lora}` : "");
        chip.addEventListener("click", () => {
          selectedRequest = selectedRequest === r.id ? null : r.id;
          renderRequests(); renderTables();
        });
        div.appendChild(chip);
      }
      box.appendChild(div);
    }
  }

  function shortId(id) {
    return id.length > 20 ? id.slice(0, 9) + "\u2026" + id.slice(-8) : id;
  }

  function renderTables() {
    for (const pool of ["device", "host"]) for (const c of cells[pool]) c.classList.remove("selected");
    const box = $("tables");
    box.innerHTML = "<h2>Block tables</h2>";
    const req = page.requests.find((r) => r.id === selectedRequest);
    if (!req) {
      box.insertAdjacentHTML("beforeend", '<p class="sub">Select a request.</p>');
      return;
    }
    const head = document.createElement("p");
    head.className = "sub";
    head.textContent = `request ${req.id} (${req.status}, ${req.kind}, n=${req.n}): ` +
      "each row is a sequence's table in logical order; orange blocks are shared (copy-on-write on write)";
    box.appendChild(head);
    for (const s of req.seqs) {
      const row = document.createElement("div");
      row.className = "seqrow";
      row.dataset.seqId = s.seq_id;
      row.textContent = `seq ${s.seq_id} (${s.num_computed_tokens}/${s.num_tokens}${s.finished ? ", done" : ""}): `;
      const pool = s.pool === "host" ? "host" : "device";
      s.block_table.forEach((id, logical) => {
        const b = (pool === "host" ? page.host_blocks : page.blocks)[id];
        const chip = document.createElement("span");
        chip.className = "chip" + (pool === "host" ? " host" : "");
        chip.dataset.state = b.state;
        chip.dataset.blockId = id;
        chip.title = `logical block ${logical} -> ${pool} block ${id}, ref count ${b.ref_cnt}`;
        chip.textContent = id;
        row.appendChild(chip);
        const cell = cells[pool][id];
        if (cell) cell.classList.add("selected");
      });
      box.appendChild(row);
    }
  }

  function renderDetail() {
    const box = $("detail");
    for (const pool of ["device", "host"]) for (const c of cells[pool]) c.classList.remove("focus");
    if (!focusBlock || !page) return;
    const b = blockOf(focusBlock);
    if (!b) return;
    cells[focusBlock.pool][b.id].classList.add("focus");
    box.innerHTML = "<h2></h2><dl></dl>";
    box.firstChild.textContent = `${focusBlock.pool === "host" ? "Host block" : "Block"} ${b.id}`;
    const dl = box.lastChild;
    const rows = [["state", b.state], ["ref count", String(b.ref_cnt)], ["owners", b.owners.join(", ") || "-"],
                  ["sequences", b.seqs.join(", ") || "-"], ["hash", b.hash ? b.hash + "..." : "- (not cached)"]];
    if (b.group !== undefined) rows.push(["KV group", String(b.group)]);   // a hybrid model's (kv/groups.py)
    for (const [k, v] of rows) {
      const dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = k; dd.textContent = v;
      dd.dataset.field = k.replace(" ", "_");
      dl.append(dt, dd);
    }
    if (b.text !== undefined) {
      const dt = document.createElement("dt"), dd = document.createElement("dd"), pre = document.createElement("pre");
      dt.textContent = "tokens"; pre.textContent = b.text; dd.dataset.field = "text";
      dd.appendChild(pre);
      dl.append(dt, dd);
    } else if (b.hidden) {   // a request with a cache_salt: its tokens are its tenant's
      const dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = "tokens"; dd.textContent = "hidden (cache_salt)"; dd.dataset.field = "text";
      dl.append(dt, dd);
    }
  }

  // ---- live: the event stream -------------------------------------------------------------------
  function headers() {
    const key = sessionStorage.getItem(KEY_NAME);
    return key ? { Authorization: "Bearer " + key } : {};
  }

  function setStatus(text, connected) {
    $("status").textContent = text;
    $("status").dataset.connected = connected ? "1" : "0";
  }

  function askKey(message) {
    const form = $("auth");
    form.hidden = false;
    $("auth-error").textContent = message || "";
    $("api-key").focus();
    setStatus("waiting for the API key", false);
  }

  function handleEvent(chunk) {
    let event = "message", data = "";
    for (const line of chunk.split("\n")) {
      if (line.startsWith("event: ")) event = line.slice(7);
      else if (line.startsWith("data: ")) data += line.slice(6);
    }
    if (!data) return;
    const msg = JSON.parse(data);
    if (event === "snapshot") applySnapshot(msg);
    else if (event === "update" && page) applyUpdate(msg);
  }

  async function connect() {
    let res;
    try {
      res = await fetch("/v1/kv/stream", { headers: headers(), cache: "no-store" });
    } catch (e) {
      setStatus("cannot reach the server; retrying", false);
      setTimeout(connect, 2000);
      return;
    }
    if (res.status === 401) {
      const hadKey = sessionStorage.getItem(KEY_NAME) !== null;
      sessionStorage.removeItem(KEY_NAME);
      askKey(hadKey ? "that key was refused" : "");
      return;
    }
    if (!res.ok) {
      setStatus(`the server answered ${res.status}; retrying`, false);
      setTimeout(connect, 2000);
      return;
    }
    $("auth").hidden = true;
    setStatus("live", true);
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          handleEvent(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
    } catch (e) { /* connection lost */ }
    setStatus("disconnected; reconnecting", false);
    setTimeout(connect, 1000);
  }

  $("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_NAME, $("api-key").value);
    $("auth").hidden = true;
    setStatus("connecting...", false);
    connect();
  });

  // ---- replay: frames embedded in the file ------------------------------------------------------
  function startReplay(frames) {
    const slider = $("frame"), label = $("frame-label"), play = $("play");
    $("replay-controls").hidden = false;
    slider.max = frames.length - 1;
    let shown = -1, timer = null;
    function show(i) {
      if (i < shown || shown < 0) {   // back in time: rebuild from the first frame
        history = [];
        applySnapshot(JSON.parse(JSON.stringify(frames[0])));
        shown = 0;
      }
      for (let j = shown + 1; j <= i; j++) applyUpdate(JSON.parse(JSON.stringify(frames[j])));
      shown = i;
      slider.value = i;
      label.textContent = `frame ${i + 1}/${frames.length}, step ${page.step}`;
    }
    slider.addEventListener("input", () => show(Number(slider.value)));
    play.addEventListener("click", () => {
      if (timer) { clearInterval(timer); timer = null; play.textContent = "play"; return; }
      if (shown >= frames.length - 1) show(0);
      play.textContent = "pause";
      timer = setInterval(() => {
        if (shown >= frames.length - 1) { clearInterval(timer); timer = null; play.textContent = "play"; return; }
        show(shown + 1);
      }, 150);
    });
    setStatus(`replay of ${frames.length} steps`, true);
    show(frames.length - 1);
    window.pagedserveReplay = { show, frames: frames.length };
  }

  window.pagedserveDashboard = { page: () => page };
  if (window.PAGEDSERVE_REPLAY) startReplay(window.PAGEDSERVE_REPLAY.frames);
  else connect();
})();
