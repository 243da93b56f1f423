// The KV-cache map: every block of the pool as a cell of a canvas, coloured by what holds it, with a list of
// the running requests (hover one to outline its blocks) and the cache's slot figures beside it.
//
// Cells are drawn one pixel each into an offscreen image, then scaled up without smoothing, so a refresh
// costs a loop over the blocks however large they are drawn. When blocks outnumber the canvas's pixels,
// each cell stands for several consecutive blocks and takes their average colour.

import { fitCanvas } from "./chart.js";
import { blockIds, decodeBlockStates, numBlocks, percent, tableRow } from "./state.js";

const MAX_HEIGHT_PX = 520;
const MAX_CELL_PX = 18;
const MIN_GAP_CELL_PX = 5; // cells this large get a 1 px gap, so single blocks can be told apart
const COLOURS = {
  free: [229, 231, 235],
  shared: [76, 29, 149],
  evictable: [153, 246, 228],
  unfilled: [254, 215, 170],
};

// A colour per running request, by its position in the list: golden-angle hues keep neighbours apart.
export function requestColour(index) {
  return hslToRgb((index * 137.508 + 200) % 360, 0.7, 0.5);
}

function hslToRgb(hue, saturation, lightness) {
  const chroma = (1 - Math.abs(2 * lightness - 1)) * saturation;
  const f = (n) => {
    const k = (n + hue / 30) % 12;
    return Math.round(255 * (lightness - (chroma / 2) * Math.max(-1, Math.min(k - 3, 9 - k, 1))));
  };
  return [f(0), f(8), f(4)];
}

const css = ([r, g, b]) => `rgb(${r}, ${g}, ${b})`;

// Cell size and grid for `numBlocks` blocks in a canvas `width` CSS pixels wide.
export function mapLayout(numBlocks, width) {
  const pixels = width * MAX_HEIGHT_PX;
  const blocksPerCell = Math.max(1, Math.ceil(numBlocks / pixels));
  const cellPx = blocksPerCell > 1 ? 1 : Math.max(1, Math.min(MAX_CELL_PX, Math.floor(Math.sqrt(pixels / numBlocks))));
  const numCells = Math.ceil(numBlocks / blocksPerCell);
  const columns = Math.max(1, Math.floor(width / cellPx));
  return { blocksPerCell, cellPx, numCells, columns, rows: Math.ceil(numCells / columns) };
}

export class KVMapView {
  constructor(root) {
    this.root = root;
    this.canvas = this.$("kv-canvas");
    this.state = null;
    this.highlighted = null; // request id whose blocks are outlined
    this.canvas.addEventListener("mousemove", (event) => this.describeAt(event.offsetX, event.offsetY));
    this.canvas.addEventListener("mouseleave", () => {
      this.$("kv-hover").textContent = "Hover a block to see what holds it.";
    });
  }

  $(id) {
    return this.root.querySelector(`#${id}`);
  }

  update(state) {
    const kv = state.kv_cache;
    const running = state.requests.running;
    const states = decodeBlockStates(kv);
    const owner = new Int32Array(states.length).fill(-1); // index in `running` of the request holding a block
    const holders = new Map(); // shared block id -> ids of the running requests holding it
    const stateNames = kv.state_names;
    running.forEach((request, index) => {
      for (const [start, end] of request.block_ranges) {
        for (let block = start; block < end; block++) {
          if (stateNames[states[block]] === "shared") {
            if (!holders.has(block)) holders.set(block, []);
            holders.get(block).push(request.request_id);
          }
          owner[block] = index;
        }
      }
    });
    this.state = { kv, running, states, owner, holders, refCounts: new Map(kv.shared) };
    if (!running.some((request) => request.request_id === this.highlighted)) this.highlighted = null;
    this.draw();
    this.showFigures();
    this.showRequests();
  }

  draw() {
    const { kv, running, states, owner } = this.state;
    const layout = mapLayout(states.length, this.canvas.clientWidth);
    this.layout = layout;
    Object.assign(this.canvas.dataset, {
      cellPx: layout.cellPx,
      columns: layout.columns,
      blocksPerCell: layout.blocksPerCell,
    });
    const { context } = fitCanvas(this.canvas, layout.rows * layout.cellPx);
    const image = new ImageData(layout.columns, layout.rows);
    const colours = running.map((_, index) => requestColour(index));
    const stateColours = kv.state_names.map((name) => COLOURS[name] ?? null); // held: the owner's colour
    for (let cell = 0; cell < layout.numCells; cell++) {
      const first = cell * layout.blocksPerCell;
      const last = Math.min(first + layout.blocksPerCell, states.length);
      const sum = [0, 0, 0];
      for (let block = first; block < last; block++) {
        const colour = stateColours[states[block]] ?? colours[owner[block]] ?? COLOURS.free;
        sum[0] += colour[0];
        sum[1] += colour[1];
        sum[2] += colour[2];
      }
      const offset = cell * 4;
      image.data.set([sum[0] / (last - first), sum[1] / (last - first), sum[2] / (last - first), 255], offset);
    }
    const offscreen = document.createElement("canvas");
    offscreen.width = layout.columns;
    offscreen.height = layout.rows;
    offscreen.getContext("2d").putImageData(image, 0, 0);
    context.imageSmoothingEnabled = false;
    context.drawImage(offscreen, 0, 0, layout.columns * layout.cellPx, layout.rows * layout.cellPx);
    if (layout.blocksPerCell === 1 && layout.cellPx >= 3) this.drawUnfilledTails(context);
    if (layout.cellPx >= MIN_GAP_CELL_PX) this.drawGaps(context);
    if (this.highlighted !== null) this.drawHighlight(context);
  }

  cellBox(block) {
    const { columns, cellPx, blocksPerCell } = this.layout;
    const cell = Math.floor(block / blocksPerCell);
    return { x: (cell % columns) * cellPx, y: Math.floor(cell / columns) * cellPx, size: cellPx };
  }

  // The empty slots at the end of each request's last block(s): the right part of the cell, by share of slots.
  drawUnfilledTails(context) {
    const blockSize = this.state.kv.block_size;
    context.fillStyle = css(COLOURS.unfilled);
    for (const request of this.state.running) {
      const ids = blockIds(request);
      let unfilled = request.num_unfilled_slots;
      for (let i = ids.length - 1; i >= 0 && unfilled > 0; i--) {
        const emptySlots = Math.min(unfilled, blockSize);
        const { x, y, size } = this.cellBox(ids[i]);
        const emptyWidth = (size * emptySlots) / blockSize;
        context.fillRect(x + size - emptyWidth, y, emptyWidth, size);
        unfilled -= emptySlots;
      }
    }
  }

  drawGaps(context) {
    const { columns, rows, cellPx } = this.layout;
    context.fillStyle = "#ffffff";
    for (let column = 1; column < columns; column++) context.fillRect(column * cellPx - 1, 0, 1, rows * cellPx);
    for (let row = 1; row < rows; row++) context.fillRect(0, row * cellPx - 1, columns * cellPx, 1);
  }

  drawHighlight(context) {
    const request = this.state.running.find((candidate) => candidate.request_id === this.highlighted);
    context.strokeStyle = "#111827";
    context.fillStyle = "#111827";
    context.lineWidth = 2;
    for (const block of blockIds(request)) {
      const { x, y, size } = this.cellBox(block);
      if (size >= 4) context.strokeRect(x + 1, y + 1, size - 3, size - 3);
      else context.fillRect(x, y, size, size);
    }
  }

  describeAt(x, y) {
    if (!this.state) return;
    const { columns, cellPx, blocksPerCell } = this.layout;
    const column = Math.floor(x / cellPx);
    const cell = Math.floor(y / cellPx) * columns + column;
    const first = cell * blocksPerCell;
    if (column >= columns || first >= this.state.states.length) return;
    const last = Math.min(first + blocksPerCell, this.state.states.length) - 1;
    this.$("kv-hover").textContent = first === last ? this.describeBlock(first) : this.describeBlocks(first, last);
  }

  describeBlock(block) {
    const { kv, running, states, owner, holders, refCounts } = this.state;
    const state = kv.state_names[states[block]];
    if (state === "shared") {
      return `block ${block}: shared, ref count ${refCounts.get(block)} (running: ${holders.get(block)?.join(", ") ?? "none"})`;
    }
    if (state === "held") {
      const request = running[owner[block]];
      if (!request) return `block ${block}: held`;
      const ids = blockIds(request);
      const emptySlots = Math.max(0, request.num_unfilled_slots - (ids.length - 1 - ids.indexOf(block)) * kv.block_size);
      const filled = kv.block_size - Math.min(kv.block_size, emptySlots);
      const adapter = request.lora_name ? ` (LoRA adapter ${request.lora_name})` : "";
      return `block ${block}: held by ${request.request_id}${adapter}, ${filled} of ${kv.block_size} slots filled`;
    }
    if (state === "evictable") return `block ${block}: cached prefix, held by no request, evictable`;
    return `block ${block}: free`;
  }

  describeBlocks(first, last) {
    const { kv, states } = this.state;
    const counts = new Map();
    for (let block = first; block <= last; block++) {
      const name = kv.state_names[states[block]];
      counts.set(name, (counts.get(name) ?? 0) + 1);
    }
    const parts = [...counts].map(([name, count]) => `${count} ${name}`);
    return `blocks ${first}–${last}: ${parts.join(", ")}`;
  }

  showFigures() {
    const { kv } = this.state;
    const figures = {
      "kv-free": kv.blocks.free,
      "kv-held": kv.blocks.held,
      "kv-shared": kv.blocks.shared,
      "kv-evictable": kv.blocks.evictable,
      "kv-unfilled": kv.num_unfilled_slots,
      "kv-total": `${kv.blocks.total} blocks of ${kv.block_size} slots`,
      "kv-utilization": kv.blocks.used ? percent(kv.slot_utilization) : "–",
      "kv-fragmentation": kv.blocks.used ? percent(kv.fragmentation) : "–",
      "kv-live-tokens": kv.num_live_tokens,
      "kv-hit-rate": kv.prefix_cache_hit_rate === null ? "–" : percent(kv.prefix_cache_hit_rate),
      "kv-scale":
        this.layout.blocksPerCell > 1 ? `one cell: ${this.layout.blocksPerCell} blocks (average colour)` : "one cell: one block",
    };
    for (const [id, text] of Object.entries(figures)) this.$(id).textContent = text;
  }

  showRequests() {
    const rows = this.state.running.map((request, index) => {
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = css(requestColour(index));
      const row = tableRow([
        swatch,
        request.request_id,
        request.lora_name ?? "base",
        request.num_prompt_tokens,
        request.num_output_tokens,
        numBlocks(request),
        request.num_unfilled_slots,
        request.num_preemptions,
      ]);
      row.dataset.requestId = request.request_id;
      row.classList.toggle("highlighted", request.request_id === this.highlighted);
      row.addEventListener("mouseenter", () => this.highlight(request.request_id));
      row.addEventListener("mouseleave", () => this.highlight(null));
      return row;
    });
    this.$("kv-requests").replaceChildren(...rows);
  }

  highlight(requestId) {
    this.highlighted = requestId;
    for (const row of this.$("kv-requests").children) {
      row.classList.toggle("highlighted", row.dataset.requestId === requestId);
    }
    this.draw();
  }
}
