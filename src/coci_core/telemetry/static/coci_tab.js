// The coci tab of TensorBoard: a run's checkpoints on one timeline, their costs, a summary.
// Plain JavaScript drawing inline SVG (no build step, nothing fetched but the plugin's routes).
// Beside the timeline, in words, why the plan is what it is (the plugin's reason route).
// Test hooks: data-kind on markers (planned, committed, skipped, failed, restart, failure,
// lost, preemption, with data-decision and data-save-step), <title> children for the hover text, class "axis-label" on labels with units,
// data-reason on each line of the plan's reason (#coci-reason).

const SVG = 'http://www.w3.org/2000/svg';
const COLORS = {
  loss: '#1f77b4',
  fitted: '#ff7f0e',
  lostLoss: '#9e9e9e',
  planned: '#6a3d9a',
  revised: '#9e9e9e',
  committed: '#2e7d32',
  skipped: '#f9a825',
  failed: '#c62828',
  lost: '#c62828',
  notice: '#ef6c00',
};

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of [].concat(children)) {
    if (c == null) continue;
    node.appendChild(typeof c === 'string' ? document.createTextNode(c) : c);
  }
  return node;
}

function svg(tag, attrs = {}, children = []) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  for (const c of [].concat(children)) {
    if (c == null) continue;
    node.appendChild(typeof c === 'string' ? document.createTextNode(c) : c);
  }
  return node;
}

function title(text) {
  return svg('title', {}, text);
}

function fmt(x, digits = 2) {
  if (x == null || !isFinite(x)) return '?';
  return Number(x).toFixed(digits);
}

function plural(n, noun) {
  return `${n} ${noun}${n === 1 ? '' : 's'}`;
}

function niceTicks(lo, hi, count = 6) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9; t += step) ticks.push(+t.toFixed(10));
  return ticks;
}

// ticks of a log10 axis from lo to hi (in log10 units), as values: 1, 2 and 5 times the
// powers of ten over a few decades, the powers alone over more
function logTicks(lo, hi) {
  const ticks = [];
  const steps = hi - lo > 3 ? [1] : [1, 2, 5];
  for (let k = Math.floor(lo); k <= Math.ceil(hi); k++) {
    for (const m of steps) {
      const v = m * Math.pow(10, k);
      if (Math.log10(v) >= lo && Math.log10(v) <= hi) ticks.push(v);
    }
  }
  return ticks;
}

function scale(d0, d1, r0, r1) {
  const k = d1 > d0 ? (r1 - r0) / (d1 - d0) : 0;
  return (x) => r0 + (x - d0) * k;
}

const STYLE = `
  body { font-family: Roboto, Arial, sans-serif; margin: 12px 16px; color: #212121; }
  h2 { font-size: 16px; margin: 18px 0 6px; }
  .coci-controls { display: flex; gap: 16px; align-items: center; margin-bottom: 8px; }
  .coci-controls label { font-size: 13px; }
  .coci-legend { display: flex; flex-wrap: wrap; gap: 14px; font-size: 12px; margin: 4px 0; }
  .coci-legend span.sw { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
    vertical-align: -2px; border-radius: 2px; }
  .coci-costs { display: flex; flex-wrap: wrap; gap: 12px; }
  table.coci-summary { border-collapse: collapse; font-size: 13px; }
  table.coci-summary td, table.coci-summary th { padding: 3px 10px; text-align: left;
    border-bottom: 1px solid #e0e0e0; }
  table.coci-summary td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .axis-label { font-size: 12px; fill: #424242; }
  svg[data-chart=timeline] .axis-label { paint-order: stroke; stroke: #ffffff;
    stroke-width: 3px; stroke-linejoin: round; }
  .tick { font-size: 10px; fill: #616161; }
  .lane-label { font-size: 12px; fill: #212121; font-weight: 500; }
  .coci-note { font-size: 12px; color: #616161; }
  .coci-main { display: flex; gap: 16px; align-items: flex-start; }
  .coci-main[data-layout=below] { flex-direction: column; }
  .coci-main > svg { flex: none; }
  .coci-main[data-layout=beside] > .coci-reason { flex: 1 1 auto; min-width: 0; }
  .coci-reason { box-sizing: border-box; font-size: 13px; line-height: 1.4;
    border: 1px solid #e0e0e0; border-radius: 4px; padding: 8px 12px; background: #fafafa;
    overflow-wrap: anywhere; }
  .coci-reason h3 { font-size: 14px; margin: 2px 0 8px; }
  .coci-reason dl { margin: 0; }
  .coci-reason dt { font-weight: 500; color: #424242; }
  .coci-reason dd { margin: 0 0 7px 0; }
`;

// the reason panel's width beside the timeline; below it when the window is narrower than
// the timeline's least width plus this
const REASON_W = { min: 280, max: 420, share: 0.28 };
const TIMELINE_MIN_W = 640;
const GAP = 16;

export async function render() {
  document.head.appendChild(el('style', {}, STYLE));
  const root = el('div', { id: 'coci-root' });
  document.body.appendChild(root);
  const status = el('p', { class: 'coci-note', id: 'coci-status' }, 'Loading coci telemetry…');
  root.appendChild(status);
  let runs;
  try {
    runs = (await fetch('./runs').then((r) => r.json())).runs;
  } catch (e) {
    status.textContent = `Could not read the runs: ${e}`;
    return;
  }
  if (!runs.length) {
    status.textContent =
      'No coci run under this log directory (a run writes telemetry.jsonl beside its ' +
      'checkpoints, and coci-telemetry.json into its TensorBoard directory).';
    return;
  }
  status.remove();
  const state = { axis: 'step', logy: false, run: runs[0].name, data: null, reason: null };
  const select = el('select', { id: 'coci-run' },
    runs.map((r) => el('option', { value: r.name }, r.name)));
  const axisStep = el('input', { type: 'radio', name: 'coci-axis', value: 'step', checked: '' });
  const axisTime = el('input', { type: 'radio', name: 'coci-axis', value: 'time' });
  const logy = el('input', { type: 'checkbox', id: 'coci-logy' });
  const controls = el('div', { class: 'coci-controls' }, [
    el('label', {}, ['run ', select]),
    el('span', { class: 'coci-note' }, 'x axis:'),
    el('label', {}, [axisStep, ' training step']),
    el('label', {}, [axisTime, ' wall time']),
    el('label', {}, [logy, ' loss on a log scale']),
  ]);
  const view = el('div', { id: 'coci-view' });
  root.append(controls, view);

  const draw = () => {
    view.replaceChildren();
    if (state.data) {
      drawRun(view, state.data, state.reason, state.axis, root.clientWidth || 1000, state.logy);
      for (const chart of view.querySelectorAll('svg[data-chart]')) fitLabels(chart);
    }
    axisTime.disabled = !(state.data && state.data.has_time);
    logy.disabled = !(state.data && positiveLoss(state.data));
  };
  const load = async () => {
    const query = new URLSearchParams({ run: state.run });
    const [data, reason] = await Promise.all([
      fetch('./timeline?' + query).then((r) => r.json()),
      fetch('./reason?' + query).then((r) => (r.ok ? r.json() : null)).catch(() => null),
    ]);
    state.data = data;
    state.reason = reason;
    if (!state.data.has_time) state.axis = 'step';
    draw();
  };
  select.addEventListener('change', () => { state.run = select.value; load(); });
  for (const radio of [axisStep, axisTime]) {
    radio.addEventListener('change', () => { state.axis = radio.value; draw(); });
  }
  logy.addEventListener('change', () => { state.logy = logy.checked; draw(); });
  window.addEventListener('resize', draw);
  await load();
}

// every loss value drawn is above 0: a log scale can show them
function positiveLoss(data) {
  const values = data.loss.flatMap((p) => [p.loss, p.fitted]).filter((v) => v != null);
  return values.length > 0 && values.every((v) => v > 0);
}

function drawRun(view, data, reason, axis, width, logy = false) {
  view.setAttribute('data-run', data.run);
  view.setAttribute('data-axis', axis);
  view.appendChild(el('h2', {}, `Timeline of ${data.run}`));
  if (data.skipped_note) {  // lines of the telemetry that could not be read: the rest is shown
    view.appendChild(el('p', { class: 'coci-note', 'data-skipped': String(data.skipped_lines) },
      data.skipped_note));
  }
  if (data.earlier_note) {  // runs written one after the other: this timeline is the latest's
    view.appendChild(el('p', { class: 'coci-note', 'data-earlier': String(data.earlier_runs) },
      data.earlier_note));
  }
  view.appendChild(legend(data));
  // the reason beside the timeline when both fit, else below it, never cut; room is kept for
  // the scroll bar the drawing may bring (the panel then gives up those pixels)
  const scrollbar = window.innerWidth - document.documentElement.clientWidth;
  const avail = Math.max(320, width - 4 - (scrollbar > 0 ? 0 : 17));
  const beside = avail >= TIMELINE_MIN_W + GAP + REASON_W.min;
  const panelW = beside ?
    Math.round(Math.min(REASON_W.max, Math.max(REASON_W.min, avail * REASON_W.share))) : avail;
  const chartW = beside ? avail - panelW - GAP : avail;
  const panel = reasonPanel(reason, data.summary);
  panel.style.width = `${panelW}px`;
  panel.setAttribute('data-layout', beside ? 'beside' : 'below');
  view.appendChild(el('div', { class: 'coci-main', 'data-layout': beside ? 'beside' : 'below' },
    [timelineSvg(data, axis, chartW, logy && positiveLoss(data)), panel]));
  view.appendChild(el('h2', {}, 'Costs of each checkpoint'));
  view.appendChild(costs(data));
  view.appendChild(el('h2', {}, 'Summary (the numbers of coci report)'));
  view.appendChild(summaryTable(data.summary));
}

// Why the plan is what it is: the reason route's lines, then the whole run's expected
// overhead against Daly from the summary (the numbers of coci report).
function reasonPanel(reason, summary) {
  const panel = el('aside', { class: 'coci-reason', id: 'coci-reason' });
  const made = reason && reason.plan_step != null ? ` (made at step ${reason.plan_step})` : '';
  panel.appendChild(el('h3', {}, `Why this plan${made}`));
  if (!reason || !reason.lines.length) {
    panel.appendChild(el('p', { class: 'coci-note', 'data-reason': 'none' },
      (reason && reason.note) || 'no plan recorded for this run'));
    return panel;
  }
  const rows = [];
  for (const line of reason.lines) {
    rows.push(el('dt', {}, line.label), el('dd', { 'data-reason': line.key }, line.text));
  }
  const rowOf = (name) => (summary.policies || []).find((p) => p.policy === name);
  const coci = rowOf('coci');
  const daly = rowOf('daly');
  if (coci && daly) {
    const share = daly.wall_s > 0 ? (daly.wall_s - coci.wall_s) / daly.wall_s : 0;
    const versus = Math.abs(share) < 5e-4 ? 'the same as Daly' :
      `${fmt(Math.abs(100 * share), 1)}% ${share > 0 ? 'less' : 'more'} than Daly`;
    rows.push(el('dt', {}, 'over the whole run'), el('dd', { 'data-reason': 'overhead_run' },
      `coci's plan made afresh with the costs measured by the run's end: ` +
      `${fmt(coci.wall_s)} s of wall-clock time expected over its ${summary.steps} ` +
      `steps with ${plural(coci.checkpoints, 'checkpoint')}, against Daly's ` +
      `${fmt(daly.wall_s)} s with ${daly.checkpoints}: ${versus} (from the measured costs)`));
  }
  panel.appendChild(el('dl', {}, rows));
  return panel;
}

// Keep every label of a drawn chart inside it: shrink one wider than the chart, move one that
// sticks out over an edge (the chart must be in the document: text is measured).
function fitLabels(chart) {
  const W = chart.width.baseVal.value;
  for (const text of chart.querySelectorAll('text')) {
    if (text.hasAttribute('transform')) continue; // the rotated y-axis label
    let box = text.getBBox();
    if (box.width > W - 4) {
      const size = parseFloat(getComputedStyle(text).fontSize) || 12;
      text.style.fontSize = `${Math.max(8, (size * (W - 4)) / box.width).toFixed(1)}px`;
      box = text.getBBox();
    }
    const dx = box.x < 2 ? 2 - box.x : box.x + box.width > W - 2 ? W - 2 - box.x - box.width : 0;
    if (dx) text.setAttribute('x', String(parseFloat(text.getAttribute('x')) + dx));
  }
}

// the legend of what the timeline draws (an item only when the run has one to draw)
function legend(data) {
  const item = (color, text, shape = 'square') =>
    el('span', {}, [
      el('span', {
        class: 'sw',
        style: shape === 'line' ? `background:${color};height:3px;vertical-align:3px` :
          shape === 'shade' ? `background:${color};opacity:.25` :
            shape === 'hollow' ? `border:2px solid ${color};width:8px;height:8px` :
              `background:${color}`,
      }),
      text,
    ]);
  const planned = (state) => data.planned.some((p) => p.state === state);
  const saved = (outcome) => data.saves.some((s) => s.outcome === outcome);
  const lost = data.restarts.length > 0;
  const items = [
    ['loss', data.loss.some((p) => p.loss != null), COLORS.loss, 'observed loss', 'line'],
    ['fitted', data.loss.some((p) => p.fitted != null && !p.lost), COLORS.fitted,
      "planner's fitted curve", 'line'],
    ['planned', planned('taken') || planned('missed'), COLORS.planned, 'planned checkpoint'],
    ['unreached', planned('unreached'), COLORS.planned, 'planned, not reached', 'hollow'],
    ['revised', planned('revised'), COLORS.revised, 'planned, then revised away'],
    ['committed', saved('committed'), COLORS.committed, 'save committed'],
    ['skipped', saved('skipped'), COLORS.skipped, 'save skipped'],
    ['failed', saved('failed'), COLORS.failed, 'save failed'],
    ['lost', lost, COLORS.lost, 'lost work (trained again after a restart)', 'shade'],
    ['notice', (data.preemptions || []).length > 0, COLORS.notice,
      'preemption notice (its save, hover for the decision)', 'line'],
  ];
  return el('div', { class: 'coci-legend', id: 'coci-legend' }, items
    .filter(([, drawn]) => drawn)
    .map(([key, , color, text, shape]) => {
      const node = item(color, text, shape);
      node.setAttribute('data-legend', key);
      return node;
    }));
}

// x of a record: its step, or its wall time since the run's first record
function xOf(data, axis) {
  return (step, time) => (axis === 'time' ? (time == null ? null : time - data.t0) : step);
}

function timelineSvg(data, axis, W, logy = false) {
  const X = xOf(data, axis);
  const M = { left: 78, right: 24, top: 30 };
  const lossH = 210;
  const laneH = 34;
  const lanePlanned = M.top + lossH + 18;
  const laneSaves = lanePlanned + laneH + 8;
  const axisY = laneSaves + laneH + 6;
  const H = axisY + 44;

  const xs = [0];
  for (const p of data.loss) xs.push(X(p.step, p.time));
  for (const s of data.saves) xs.push(X(s.step, s.time));
  for (const p of data.planned) xs.push(X(p.step, p.time));
  for (const r of data.restarts) xs.push(X(r.failed_at, r.failed_time), X(r.restored, r.time));
  for (const p of data.preemptions || []) xs.push(X(p.step, p.time), X(p.save_step, p.save_time));
  const xmax = Math.max(1, ...xs.filter((v) => v != null));
  const sx = scale(0, xmax, M.left, W - M.right);

  // the loss axis, linear or (logy) log10: `sy` takes a loss value either way
  const toAxis = logy ? Math.log10 : (v) => v;
  const losses = data.loss.flatMap((p) => [p.loss, p.fitted]).filter((v) => v != null)
    .map(toAxis);
  const lo = losses.length ? Math.min(...losses) : 0;
  const hi = losses.length ? Math.max(...losses) : 1;
  const pad = (hi - lo) * 0.08 || (logy ? 0.1 : 0.5);
  const syAxis = scale(lo - pad, hi + pad, M.top + lossH, M.top);
  const sy = (v) => syAxis(toAxis(v));
  const lossTicks = logy ? logTicks(lo - pad, hi + pad) : niceTicks(lo - pad, hi + pad, 5);

  const root = svg('svg', {
    width: W, height: H, viewBox: `0 0 ${W} ${H}`, 'data-chart': 'timeline',
    style: 'background:#fff',
  });

  // the lanes' backgrounds, then the lost work shaded over every lane, behind the rest
  root.append(
    svg('rect', { x: M.left, y: lanePlanned, width: W - M.left - M.right, height: laneH,
      fill: '#f5f3fa' }),
    svg('rect', { x: M.left, y: laneSaves, width: W - M.left - M.right, height: laneH,
      fill: '#f3f8f3' }),
  );
  for (const r of data.restarts) {
    const x0 = axis === 'time' ? X(null, r.restored_time) : r.restored;
    const x1 = axis === 'time' ? X(null, r.time) : r.failed_at;
    if (x0 == null || x1 == null) continue;
    const a = sx(Math.min(x0, x1));
    const b = sx(Math.max(x0, x1));
    const g = svg('g', { 'data-kind': 'lost', 'data-from': r.restored, 'data-to': r.failed_at,
      'data-steps': r.lost_steps });
    g.append(
      svg('rect', { x: a, y: M.top, width: Math.max(2, b - a), height: axisY - M.top,
        fill: COLORS.lost, 'fill-opacity': 0.13 }),
      svg('text', { x: (a + b) / 2, y: M.top - 8, 'text-anchor': 'middle',
        class: 'axis-label', fill: COLORS.lost, 'font-weight': 'bold' },
      `lost work: ${r.exact ? '' : 'at least '}${r.lost_steps} ` +
      `step${r.lost_steps === 1 ? '' : 's'}`),
      title(`lost work: steps ${r.restored}–${r.failed_at} (${r.lost_steps} step${r.lost_steps === 1 ? '' : 's'}) were ` +
        `trained again: the run failed after step ${r.failed_at} and ` +
        (r.checkpoint === false ? 'started over from step 0: no checkpoint to restore' :
          `restarted from the checkpoint of step ${r.restored}`) +
        (r.exact ? '' : '; the run may have gone further: the records of its last seconds ' +
          'were not written before it stopped (the exact number is unknown)')),
    );
    root.appendChild(g);
  }

  // axes of the loss plot
  for (const t of lossTicks) {
    root.append(
      svg('line', { x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t), stroke: '#eeeeee' }),
      svg('text', { x: M.left - 6, y: sy(t) + 3, 'text-anchor': 'end', class: 'tick',
        'data-tick': 'loss' },
      logy ? String(+t.toPrecision(2)) : fmt(t, Math.abs(hi - lo) < 1 ? 2 : 1)),
    );
  }
  root.appendChild(svg('text', {
    x: 16, y: M.top + lossH / 2, class: 'axis-label', 'text-anchor': 'middle',
    transform: `rotate(-90 16 ${M.top + lossH / 2})`, 'data-scale': logy ? 'log' : 'linear',
  }, logy ? 'loss (log scale)' : 'loss'));

  // loss: one line per stretch; a stretch later trained again is grey
  const line = (points, color, dash, kind) => {
    const pts = points.filter((p) => p.x != null && p.y != null);
    if (pts.length === 0) return;
    const d = pts.map((p, i) => `${i ? 'L' : 'M'}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`);
    root.appendChild(svg('path', { d: d.join(''), fill: 'none', stroke: color,
      'stroke-width': 2, 'stroke-dasharray': dash, 'data-kind': kind }));
    if (pts.length === 1) {
      root.appendChild(svg('circle', { cx: sx(pts[0].x), cy: sy(pts[0].y), r: 2.5,
        fill: color, 'data-kind': kind }));
    }
  };
  const stretches = [];
  let current = null;
  let prevStep = -Infinity;
  for (const p of data.loss) {
    if (!current || p.lost !== current.lost || p.step < prevStep) {
      current = { lost: p.lost, points: [] };
      stretches.push(current);
    }
    current.points.push(p);
    prevStep = p.step;
  }
  for (const s of stretches) {
    line(s.points.map((p) => ({ x: X(p.step, p.time), y: p.loss })),
      s.lost ? COLORS.lostLoss : COLORS.loss, s.lost ? '4 3' : '', s.lost ? 'loss-lost' : 'loss');
  }
  for (const s of stretches.filter((s) => !s.lost)) {
    line(s.points.map((p) => ({ x: X(p.step, p.time), y: p.fitted })), COLORS.fitted, '6 4',
      'fitted');
  }

  // lanes
  const laneLabel = (y, text) => root.appendChild(svg('text', {
    x: M.left - 8, y: y + laneH / 2 + 4, 'text-anchor': 'end', class: 'lane-label' }, text));
  laneLabel(lanePlanned, 'planned');
  laneLabel(laneSaves, 'saves');

  // the plan's revisions: a tick where a new plan replaced the old one
  for (const p of data.plans) {
    const x = X(p.step, p.time);
    if (x == null) continue;
    root.appendChild(svg('line', { x1: sx(x), x2: sx(x), y1: lanePlanned + laneH - 7,
      y2: lanePlanned + laneH, stroke: '#9575cd', 'data-kind': 'revision' },
      title(`plan made at step ${p.step}: next checkpoints ` +
        (p.next_steps.length ? p.next_steps.join(', ') : 'none before the end'))));
  }
  const cy = lanePlanned + laneH / 2 - 3;
  for (const p of data.planned) {
    const x = X(p.step, p.time);
    if (x == null) continue;
    const px = sx(x);
    const revised = p.state === 'revised';
    const color = revised ? COLORS.revised : COLORS.planned;
    const g = svg('g', { 'data-kind': 'planned', 'data-step': p.step, 'data-state': p.state });
    g.appendChild(svg('path', {
      d: `M${px},${cy - 8}L${px + 7},${cy}L${px},${cy + 8}L${px - 7},${cy}Z`,
      fill: p.state === 'taken' ? color : '#ffffff', stroke: color, 'stroke-width': 2 }));
    if (revised) {
      g.appendChild(svg('line', { x1: px - 8, x2: px + 8, y1: cy + 8, y2: cy - 8,
        stroke: COLORS.revised, 'stroke-width': 2 }));
    }
    const how = p.state === 'taken' ? 'taken' :
      revised ? `revised away by the plan of step ${p.revised_at}` :
        p.state === 'unreached' ? 'not reached' : 'not taken';
    g.appendChild(title(`planned checkpoint at step ${p.step} (planned at step ` +
      `${p.planned_at ?? '?'}): ${how}`));
    root.appendChild(g);
  }

  // actual saves, coloured by outcome
  const sy0 = laneSaves + laneH / 2;
  for (const s of data.saves) {
    const x = X(s.step, s.time);
    if (x == null) continue;
    const px = sx(x);
    const g = svg('g', { 'data-kind': s.outcome, 'data-step': s.step });
    const color = COLORS[s.outcome] || '#000';
    if (s.outcome === 'failed') {
      g.appendChild(svg('path', { d: `M${px - 6},${sy0 - 6}L${px + 6},${sy0 + 6}` +
        `M${px - 6},${sy0 + 6}L${px + 6},${sy0 - 6}`, stroke: color, 'stroke-width': 3 }));
    } else {
      g.appendChild(svg('circle', { cx: px, cy: sy0, r: 7, fill: color,
        'fill-opacity': s.outcome === 'skipped' ? 0.5 : 1, stroke: '#ffffff' }));
    }
    g.appendChild(title(saveText(s)));
    root.appendChild(g);
  }

  // failures and restarts
  for (const r of data.restarts) {
    const xf = axis === 'time' ? X(null, r.failed_time) : r.failed_at;
    const xr = axis === 'time' ? X(null, r.time) : r.restored;
    if (xf != null) {
      const g = svg('g', { 'data-kind': 'failure', 'data-step': r.failed_at });
      g.append(
        svg('line', { x1: sx(xf), x2: sx(xf), y1: M.top, y2: axisY, stroke: COLORS.failed,
          'stroke-width': 2 }),
        svg('text', { x: sx(xf) + 5, y: M.top + 14, class: 'axis-label', fill: COLORS.failed },
          `✕ failure after step ${r.failed_at}`),
        title(`the run failed after step ${r.failed_at}`),
      );
      root.appendChild(g);
    }
    if (xr != null) {
      const g = svg('g', { 'data-kind': 'restart', 'data-step': r.restored });
      g.append(
        svg('line', { x1: sx(xr), x2: sx(xr), y1: M.top, y2: axisY, stroke: COLORS.failed,
          'stroke-width': 2, 'stroke-dasharray': '5 3' }),
        svg('text', { x: sx(xr) - 5, y: M.top + 14, class: 'axis-label', fill: COLORS.failed,
          'text-anchor': 'end' }, `↻ restart from step ${r.restored}`),
        title((r.checkpoint === false ? 'started over from step 0: no checkpoint to restore' :
          `restarted from the checkpoint of step ${r.restored}; restore took ` +
          `${fmt(r.restore_s)} s`) +
          (Object.keys(r.restore_parts_s || {}).length ? ' (' + Object.entries(r.restore_parts_s)
            .map(([k, v]) => `${k} ${fmt(v)} s`).join(', ') + ')' : '') +
          (r.restart_since ? `, first step ${fmt(r.restart_s)} s after ${r.restart_since}` : '') +
          `; ${r.lost_steps} step${r.lost_steps === 1 ? '' : 's'} of work lost`),
      );
      root.appendChild(g);
    }
  }

  // preemption notices: a flag where the ranks learned of it, an arrow in the planned lane
  // to the step its save was moved to (a known end far enough ahead), the decision on hover
  for (const p of data.preemptions || []) {
    const x = X(p.step, p.time);
    if (x == null) continue;
    const px = sx(x);
    const g = svg('g', { 'data-kind': 'preemption', 'data-step': p.step,
      'data-decision': p.decision, 'data-save-step': p.save_step });
    const label = p.decision === 'saved' ? `saved step ${p.saved}` : p.decision;
    g.append(
      svg('line', { x1: px, x2: px, y1: M.top, y2: axisY, stroke: COLORS.notice,
        'stroke-width': 2, 'stroke-dasharray': '2 3' }),
      svg('text', { x: px + 5, y: M.top + 30, class: 'axis-label', fill: COLORS.notice },
        `⚑ ${p.source} notice, ${fmt(p.time_left_s, 1)} s left: ${label}`),
    );
    const xs2 = X(p.save_step, p.save_time);
    if (p.save_step !== p.step && xs2 != null) {
      const qx = sx(xs2);
      const y = lanePlanned + 6;
      g.append(
        svg('line', { x1: px, x2: qx, y1: y, y2: y, stroke: COLORS.notice, 'stroke-width': 2 }),
        svg('path', { d: `M${qx},${y}L${qx - 6},${y - 4}L${qx - 6},${y + 4}Z`,
          fill: COLORS.notice }),
      );
    }
    g.appendChild(title(p.text + (p.reason && p.decision !== 'not saved' ?
      ` (${p.reason})` : '')));
    root.appendChild(g);
  }

  // x axis
  root.appendChild(svg('line', { x1: M.left, x2: W - M.right, y1: axisY, y2: axisY,
    stroke: '#616161' }));
  for (const t of niceTicks(0, xmax, 10)) {
    root.append(
      svg('line', { x1: sx(t), x2: sx(t), y1: axisY, y2: axisY + 5, stroke: '#616161' }),
      svg('text', { x: sx(t), y: axisY + 17, 'text-anchor': 'middle', class: 'tick' }, String(t)),
    );
  }
  root.appendChild(svg('text', { x: (M.left + W - M.right) / 2, y: axisY + 36,
    'text-anchor': 'middle', class: 'axis-label', 'data-axis': axis },
  axis === 'time' ? 'wall time (s since the run started)' : 'training step'));
  return root;
}

function saveText(s) {
  if (s.outcome === 'skipped') {
    return `step ${s.step}: save skipped (${s.error || 'the previous one was still being written'}); ` +
      `stall ${fmt(s.stall_ms)} ms`;
  }
  if (s.outcome === 'failed') {
    return `step ${s.step}: save failed (${s.error || '?'}); stall ${fmt(s.stall_ms)} ms`;
  }
  const compression = s.compressed && s.compression_x ?
    `compression ${fmt(s.compression_x)}x smaller` : 'not compressed';
  return `step ${s.step}: committed; stall ${fmt(s.stall_ms)} ms, persist ` +
    `${fmt(s.persist_s, 3)} s, ${fmt(s.mb, 2)} MB, ${compression}`;
}

function barChart(name, label, points, color, digits) {
  const W = 250;
  const H = 170;
  const M = { left: 52, right: 10, top: 12, bottom: 40 };
  const root = svg('svg', { width: W, height: H, 'data-chart': name, style: 'background:#fff' });
  const vmax = Math.max(0, ...points.map((p) => p.value));
  const top = vmax > 0 ? vmax * 1.1 : 1;
  const sy = scale(0, top, H - M.bottom, M.top);
  for (const t of niceTicks(0, top, 4)) {
    root.append(
      svg('line', { x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t), stroke: '#eeeeee' }),
      svg('text', { x: M.left - 4, y: sy(t) + 3, 'text-anchor': 'end', class: 'tick' },
        fmt(t, t >= 10 || t === 0 ? 0 : digits)),
    );
  }
  const n = Math.max(1, points.length);
  const band = (W - M.left - M.right) / n;
  points.forEach((p, i) => {
    const x = M.left + i * band + band * 0.15;
    const g = svg('g', { 'data-kind': 'cost', 'data-step': p.step });
    g.append(
      svg('rect', { x, y: sy(p.value), width: band * 0.7, height: sy(0) - sy(p.value),
        fill: color }),
      title(`step ${p.step}: ${fmt(p.value, digits)} ${p.unit}`),
    );
    if (n <= 12) {
      g.appendChild(svg('text', { x: x + band * 0.35, y: H - M.bottom + 12,
        'text-anchor': 'middle', class: 'tick' }, String(p.step)));
    }
    root.appendChild(g);
  });
  if (!points.length) {
    root.appendChild(svg('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle',
      class: 'tick' }, 'none'));
  }
  root.appendChild(svg('line', { x1: M.left, x2: W - M.right, y1: sy(0), y2: sy(0),
    stroke: '#616161' }));
  root.appendChild(svg('text', { x: (M.left + W - M.right) / 2, y: H - 8,
    'text-anchor': 'middle', class: 'axis-label' }, label));
  return root;
}

function costs(data) {
  const committed = data.saves.filter((s) => s.outcome === 'committed');
  const pts = (key, unit, rows = committed) =>
    rows.filter((s) => s[key] != null).map((s) => ({ step: s.step, value: s[key], unit }));
  const restarts = data.restarts.filter((r) => r.restart_s != null)
    .map((r) => ({ step: r.restored, value: r.restart_s, unit: 's' }));
  return el('div', { class: 'coci-costs' }, [
    barChart('stall', 'stall per save (ms), by step',
      pts('stall_ms', 'ms', data.saves), '#5c6bc0', 1),
    barChart('persist', 'persist per save (s), by step', pts('persist_s', 's'), '#26a69a', 3),
    barChart('bytes', 'checkpoint size (MB), by step', pts('mb', 'MB'), '#8d6e63', 2),
    barChart('compression', "compression (x smaller), by step",
      pts('compression_x', 'x smaller'), '#78909c', 2),
    barChart('restart', 'restart to first step (s), by step restored', restarts, COLORS.failed, 3),
  ]);
}

function summaryTable(f) {
  const row = (key, label, value) =>
    el('tr', {}, [el('td', {}, label), el('td', { class: 'num', 'data-fact': key }, value)]);
  const table = el('table', { class: 'coci-summary', id: 'coci-summary' }, [
    row('planned', 'checkpoints planned (as the run reached them)', String(f.planned)),
    row('taken', 'of them taken', String(f.taken)),
    row('committed', 'checkpoints committed (the final save included)', String(f.committed)),
    row('skipped', 'saves skipped / failed', `${f.skipped} / ${f.failed}`),
    row('total_stall_s', 'total stall (s)', fmt(f.total_stall_s, 3)),
    row('restarts', 'restarts after a failure', String(f.restarts)),
    ...(f.resumes ? [row('resumes', 'resumes where the run had ended', String(f.resumes))] : []),
    row('lost_steps', 'lost work (steps)',
      `${f.lost_exact === false ? 'at least ' : ''}${f.lost_steps}`),
    row('steps', 'steps trained', String(f.steps)),
    ...(f.termination ? [row('termination',
      "expected overhead the termination hazard saves (vs the plan made without it)",
      `${Math.round(100 * f.termination.saving)}%`)] : []),
  ]);
  const policies = el('table', { class: 'coci-summary', id: 'coci-policies' }, [
    el('tr', {}, [
      el('th', {}, 'policy'),
      el('th', {}, 'checkpoints'),
      el('th', {}, `expected overhead over ${f.steps} steps (s, wall-clock)`),
      el('th', {}, 'by its objective (s)'),
    ]),
    ...f.policies.map((p) => el('tr', { 'data-policy': p.policy }, [
      el('td', {}, p.policy),
      el('td', { class: 'num' }, String(p.checkpoints)),
      el('td', { class: 'num' }, fmt(p.wall_s)),
      el('td', { class: 'num' }, fmt(p.objective_s)),
    ])),
  ]);
  const note = f.policies.length ?
    el('p', { class: 'coci-note', id: 'coci-policies-note' }, "each policy's plan for the " +
      `whole run, made afresh with the costs measured by its end: not the plan the run ` +
      'followed (made as it measured them), and without the final save') :
    el('p', { class: 'coci-note', id: 'coci-policies-note' },
      `policies not compared: ${f.not_compared || 'no measured costs yet'}`);
  return el('div', { style: 'display:flex;gap:32px;align-items:flex-start' },
    [table, el('div', {}, [policies, note])]);
}
