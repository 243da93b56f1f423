// Reading GET /v1/engine/state: the block map's encodings and the figures both views show.

// One byte per block, indexed by block id; each byte indexes `kv.state_names`.
export function decodeBlockStates(kv) {
  if (kv.encoding === "base64") return Uint8Array.from(atob(kv.states), (char) => char.charCodeAt(0));
  const states = new Uint8Array(kv.blocks.total);
  let next = 0;
  for (const [state, length] of kv.states) {
    states.fill(state, next, next + length);
    next += length;
  }
  return states;
}

export function numBlocks(request) {
  return request.block_ranges.reduce((sum, [start, end]) => sum + end - start, 0);
}

// A request's block ids in block-table order.
export function blockIds(request) {
  return request.block_ranges.flatMap(([start, end]) => Array.from({ length: end - start }, (_, i) => start + i));
}

export function tableRow(values) {
  const row = document.createElement("tr");
  for (const value of values) {
    const cell = document.createElement("td");
    if (value instanceof Node) cell.append(value);
    else cell.textContent = value;
    row.append(cell);
  }
  return row;
}

export const percent = (share) => `${(share * 100).toFixed(share < 0.1 ? 1 : 0)}%`;
