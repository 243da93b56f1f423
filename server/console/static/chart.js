// A line chart on a canvas for the live view's one-minute series: one sample a second, oldest first.

const PAD = { left: 44, right: 8, top: 8, bottom: 18 };

// Sizes the canvas's backing store to its CSS box at the screen's pixel ratio; returns a context in CSS pixels.
export function fitCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const cssWidth = canvas.clientWidth;
  canvas.style.height = `${cssHeight}px`;
  canvas.width = Math.round(cssWidth * ratio);
  canvas.height = Math.round(cssHeight * ratio);
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { context, width: cssWidth, height: cssHeight };
}

// `series`: [{ values, colour }]; `max` fixes the y range's top (1 for a share), else it follows the
// data (a count); `format` writes a y value.
export function drawLineChart(canvas, series, { max = null, format = String, height = 140 } = {}) {
  const { context, width, height: cssHeight } = fitCanvas(canvas, height);
  const plotWidth = width - PAD.left - PAD.right;
  const plotHeight = cssHeight - PAD.top - PAD.bottom;
  // Counts get an even top, so the middle grid line is a whole number too.
  const top = max ?? 2 * Math.ceil(Math.max(1, ...series.flatMap((line) => line.values)) / 2);
  const numSamples = Math.max(...series.map((line) => line.values.length));
  const x = (i) => PAD.left + (numSamples > 1 ? (i / (numSamples - 1)) * plotWidth : plotWidth);
  const y = (value) => PAD.top + plotHeight - (value / top) * plotHeight;

  context.clearRect(0, 0, width, cssHeight);
  context.font = "11px system-ui, sans-serif";
  context.fillStyle = "#6b7280";
  context.strokeStyle = "#e5e7eb";
  context.lineWidth = 1;
  for (const fraction of [0, 0.5, 1]) {
    const lineY = Math.round(y(top * fraction)) + 0.5;
    context.beginPath();
    context.moveTo(PAD.left, lineY);
    context.lineTo(width - PAD.right, lineY);
    context.stroke();
    context.textAlign = "right";
    context.fillText(format(top * fraction), PAD.left - 4, lineY + 4);
  }
  context.textAlign = "left";
  context.fillText(`-${numSamples}s`, PAD.left, cssHeight - 4);
  context.textAlign = "right";
  context.fillText("now", width - PAD.right, cssHeight - 4);

  for (const line of series) {
    context.strokeStyle = line.colour;
    context.lineWidth = 2;
    context.beginPath();
    line.values.forEach((value, i) => (i ? context.lineTo(x(i), y(value)) : context.moveTo(x(i), y(value))));
    context.stroke();
  }
}
