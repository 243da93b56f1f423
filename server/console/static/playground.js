// The playground: a chat or a completion streamed through the same /v1 routes as any client, with each
// answer's time to first token, tokens/s and finish reason. Stop aborts the fetch; the server sees the
// connection close and frees the request's blocks.

import { streamEvents } from "./api.js";

export class Playground {
  constructor(root) {
    this.root = root;
    this.messages = []; // the chat so far, as the API takes it
    this.controller = null; // the answer in flight, if any
    this.$("play-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.$("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && this.mode() === "chat") {
        event.preventDefault();
        this.send();
      }
    });
    this.$("stop").addEventListener("click", () => this.controller?.abort());
    this.$("clear").addEventListener("click", () => this.clear());
    for (const radio of root.querySelectorAll("input[name=mode]")) radio.addEventListener("change", () => this.clear());
  }

  $(id) {
    return this.root.querySelector(`#${id}`);
  }

  mode() {
    return this.root.querySelector("input[name=mode]:checked").value;
  }

  setModels(ids) {
    const select = this.$("model");
    const chosen = select.value;
    select.replaceChildren(...ids.map((id) => new Option(id, id, false, id === chosen)));
  }

  clear() {
    this.controller?.abort();
    this.messages = [];
    this.$("transcript").replaceChildren();
  }

  // The sampling fields; empty optional inputs are left out so the server's defaults apply.
  samplingFields() {
    const number = (id) => (this.$(id).value === "" ? undefined : Number(this.$(id).value));
    const stop = this.$("stop-strings")
      .value.split("\n")
      .filter((line) => line !== "");
    return {
      model: this.$("model").value,
      max_tokens: number("max-tokens"),
      temperature: number("temperature"),
      top_p: number("top-p"),
      top_k: number("top-k"),
      seed: number("seed"),
      stop: stop.length ? stop : undefined,
      stream_options: { include_usage: true },
    };
  }

  async send() {
    const text = this.$("prompt").value;
    if (!text.trim() || this.controller) return;
    const chat = this.mode() === "chat";
    const body = this.samplingFields();
    if (chat) body.messages = [...this.messages, { role: "user", content: text }];
    else body.prompt = text;
    this.addTurn(chat ? "user" : "prompt", text);
    const answer = this.addTurn("assistant", "");
    this.$("prompt").value = "";
    this.controller = new AbortController();
    this.setBusy(true);

    const timing = { startedAt: performance.now(), firstAt: null, lastAt: null, numChunks: 0 };
    let output = "";
    let finishReason = null;
    let usage = null;
    try {
      const path = chat ? "/v1/chat/completions" : "/v1/completions";
      for await (const chunk of streamEvents(path, body, this.controller.signal)) {
        usage = chunk.usage ?? usage;
        for (const choice of chunk.choices ?? []) {
          const piece = chat ? (choice.delta?.content ?? "") : (choice.text ?? "");
          if (piece) {
            timing.firstAt ??= performance.now();
            timing.lastAt = performance.now();
            timing.numChunks += 1;
            output += piece;
            answer.text.textContent = output;
            answer.element.scrollIntoView({ block: "end" });
          }
          finishReason = choice.finish_reason ?? finishReason;
        }
      }
    } catch (error) {
      if (error.name === "AbortError") finishReason = "stopped";
      else answer.showError(error.message);
    }
    if (chat && finishReason) this.messages.push({ role: "user", content: text }, { role: "assistant", content: output });
    if (finishReason) answer.showStats(timing, usage, finishReason);
    this.controller = null;
    this.setBusy(false);
  }

  setBusy(busy) {
    this.$("send").disabled = busy;
    this.$("stop").disabled = !busy;
  }

  addTurn(role, text) {
    const element = document.createElement("div");
    element.className = `turn ${role}`;
    const textElement = document.createElement("div");
    textElement.className = "text";
    textElement.textContent = text;
    element.append(textElement);
    this.$("transcript").append(element);
    return {
      element,
      text: textElement,
      showError(message) {
        const error = document.createElement("div");
        error.className = "error api-error";
        error.textContent = message;
        element.append(error);
      },
      showStats(timing, usage, finishReason) {
        element.append(statsLine(timing, usage, finishReason));
      },
    };
  }
}

// "TTFT 120 ms · 38.2 tokens/s · 64 tokens · finish: length". Tokens/s is the decode speed: tokens after the
// first over the time after the first. Counts are the server's usage figures; a stopped answer has none, so
// its count is of the chunks received.
function statsLine(timing, usage, finishReason) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const numTokens = usage?.completion_tokens ?? timing.numChunks;
  const parts = [];
  if (timing.firstAt !== null) {
    parts.push(["ttft", `TTFT ${Math.round(timing.firstAt - timing.startedAt)} ms`]);
    const decodeS = (timing.lastAt - timing.firstAt) / 1000;
    const rate = numTokens > 1 && decodeS > 0 ? ((numTokens - 1) / decodeS).toFixed(1) : "–";
    parts.push(["rate", `${rate} tokens/s`]);
  }
  parts.push(["tokens", usage ? `${numTokens} tokens` : `${numTokens} chunks`]);
  parts.push(["finish", `finish: ${finishReason}`]);
  for (const [name, text] of parts) {
    const part = document.createElement("span");
    part.className = name;
    part.textContent = text;
    stats.append(part);
  }
  return stats;
}
