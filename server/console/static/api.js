// Talking to kvserve's /v1 routes: the API key (kept in this tab's session storage), JSON GETs,
// and streamed generations read as server-sent events.

const KEY_STORAGE = "kvserve.apiKey";

export class ApiError extends Error {
  constructor(status, message, param) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

// Whoever shows the key dialog listens for this; any 401 raises it.
export const unauthorized = new EventTarget();

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The API's own message when the body is an OpenAI error object, else the HTTP status.
async function errorOf(response) {
  let message = `HTTP ${response.status} ${response.statusText}`;
  let param = null;
  try {
    const body = await response.json();
    if (body.error?.message) {
      message = body.error.message;
      param = body.error.param ?? null;
    }
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401) unauthorized.dispatchEvent(new Event("unauthorized"));
  return new ApiError(response.status, message, param);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// Yields each event's JSON object until [DONE]. An error object sent mid-stream (the server could no longer
// change the status) is thrown as an ApiError; `signal` aborts the request, which the server sees as a
// disconnect and answers by freeing the request's blocks.
export async function* streamEvents(path, body, signal) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += value;
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) throw new ApiError(payload.error.code ?? 500, payload.error.message, payload.error.param);
      yield payload;
    }
  }
}
