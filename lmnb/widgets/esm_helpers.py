"""The JavaScript the widgets' front ends share. anywidget loads a widget's `_esm` from a string,
where no relative `import` can reach a sibling file, so each widget's `_esm` starts with
`ESM_HELPERS`."""

from __future__ import annotations

ESM_HELPERS = r"""
const SVG = "http://www.w3.org/2000/svg";

// An HTML element with class `cls` (none if empty) and text `text` (none if undefined).
function node(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// An SVG element with attributes `attrs` and text `text` (none if undefined).
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

// A rate in [0, 1] as a percentage; null or undefined: "n/a".
const pct = (x) => (x === null || x === undefined) ? "n/a" : (100 * x).toFixed(1) + "%";

// Calls `draw` now and on each of the model's `events` ("change:<trait>"); returns what stops it,
// for `render` to return (anywidget calls it when the view is removed).
function redrawOn(model, events, draw) {
  for (const name of events) model.on(name, draw);
  draw();
  return () => { for (const name of events) model.off(name, draw); };
}
"""
