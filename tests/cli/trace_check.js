// Checks a merged trace (`xirang trace merge`) of a dp2 x tp2 x pp2 run
// traced over steps 2-4 with a checkpoint save and an evaluation in the
// window, against rank 0's metrics.jsonl.
// Usage: node trace_check.js MERGED.json METRICS.jsonl
// Prints one "ok" line, or the failed checks (one a line) and exits 1.
'use strict';
const fs = require('fs');

const [mergedPath, metricsPath] = process.argv.slice(2);
const failures = [];
const check = (cond, msg) => { if (!cond) failures.push(msg); };

const trace = JSON.parse(fs.readFileSync(mergedPath, 'utf8'));
const od = trace.otherData || {};
const world = od.world_size;
const firstStep = 2, lastStep = 4, steps = [2, 3, 4];
check(od.format === 'xirang-trace-merged-1', `format is ${od.format}`);
check(world === 8, `world_size ${world}, expected 8`);
check(od.first_step === firstStep && od.last_step === lastStep, `steps ${od.first_step}-${od.last_step}, expected 2-4`);
check(Array.isArray(od.ranks) && od.ranks.length === world, 'otherData.ranks does not list every rank');
const ranks = od.ranks || [];

// One process per rank, named by the coordinates otherData gives it.
const names = {};
for (const e of trace.traceEvents)
  if (e.ph === 'M' && e.name === 'process_name') (names[e.pid] = names[e.pid] || []).push(e.args.name);
check(Object.keys(names).length === world, `${Object.keys(names).length} processes, expected ${world}`);
ranks.forEach((r, i) => {
  check(r.rank === i, `otherData.ranks[${i}] is rank ${r.rank}`);
  const want = `rank ${i} (dp ${r.dp}, tp ${r.tp}, pp ${r.pp})`;
  check(names[i] && names[i].length === 1 && names[i][0] === want, `process ${i} is named ${names[i]}, expected "${want}"`);
});
// The layout: tp fastest, then dp, then pp (every coordinate pair once).
check(new Set(ranks.map(r => `${r.dp}${r.tp}${r.pp}`)).size === world, 'two ranks share coordinates');

// Clock offsets: the ranks share one machine and so one steady clock
// (CLOCK_MONOTONIC is system-wide), so the barrier's exit differs between
// ranks only by the barrier's own skew and scheduling: well under 50 ms.
for (const r of ranks) check(Math.abs(r.clock_offset_us) < 50e3, `rank ${r.rank}'s clock offset is ${r.clock_offset_us} us`);

// Complete events: finite times, no negative duration, a known process.
const spans = trace.traceEvents.filter(e => e.ph === 'X');
const bad = spans.filter(e => !Number.isFinite(e.ts) || !Number.isFinite(e.dur) || e.dur < 0 || !(e.pid >= 0 && e.pid < world));
check(bad.length === 0, `${bad.length} events with a bad ts, dur or pid, e.g. ${JSON.stringify(bad[0])}`);
// Per thread: spans on the training thread nest or follow one another; a
// transfer lane's spans are disjoint (overlapping transfers go to lanes).
const threads = {};
for (const e of spans) (threads[`${e.pid}/${e.tid}`] = threads[`${e.pid}/${e.tid}`] || []).push(e);
for (const [key, list] of Object.entries(threads)) {
  list.sort((a, b) => a.ts - b.ts || b.dur - a.dur);
  const open = [];
  for (const e of list) {
    while (open.length && open[open.length - 1].ts + open[open.length - 1].dur <= e.ts + 0.001) open.pop();
    const p = open[open.length - 1];
    if (p && (e.cat !== 'compute' || e.ts + e.dur > p.ts + p.dur + 0.001)) {
      check(false, `process/thread ${key}: ${e.name} at ${e.ts} overlaps ${p.name} (${p.ts} + ${p.dur}) without nesting in it`);
      break;
    }
    open.push(e);
  }
}
// After the merge the barrier is t = 0: every step span starts after it.
const byRank = Array.from({ length: world }, (_, r) => spans.filter(e => e.pid === r));
byRank.forEach((ev, r) => {
  const stepSpans = ev.filter(e => e.name === 'step' && e.cat === 'compute');
  const nums = stepSpans.map(e => e.args.step).sort((a, b) => a - b);
  check(JSON.stringify(nums) === JSON.stringify(steps), `rank ${r} has step spans ${JSON.stringify(nums)}, expected [2,3,4]`);
  // The first traced step starts right after the barrier: near t = 0 on every rank once aligned.
  const first = stepSpans.find(e => e.args.step === firstStep);
  check(first && Math.abs(first.ts) < 50e3, `rank ${r}'s step ${firstStep} starts at ${first && first.ts} us, not near 0`);
  const has = (pred, what) => check(ev.some(pred), `rank ${r} has no ${what}`);
  has(e => e.cat.startsWith('dp reductions') && e.name === 'dp_all_reduce' && e.args.bytes > 0, 'dp_all_reduce span');
  has(e => e.cat === 'compute' && /^tp_(all_reduce|all_gather|reduce_scatter)$/.test(e.name), 'tp collective span');
  has(e => e.cat.startsWith('pp sends') && /^send_(activation|gradient)$/.test(e.name), 'pp send span');
  has(e => e.cat.startsWith('pp receives') && /^recv_(activation|gradient)$/.test(e.name), 'pp receive span');
  has(e => e.cat === 'compute' && e.name === 'checkpoint_save' && e.args.step === 3, 'checkpoint_save of step 3');
  has(e => e.cat === 'compute' && e.name === 'checkpoint_snapshot', 'checkpoint_snapshot span');
  has(e => e.cat.startsWith('checkpoint writer') && e.name === 'checkpoint_write', 'checkpoint_write span');
  has(e => e.cat === 'compute' && e.name === 'eval', 'eval span');
  has(e => e.cat === 'compute' && (e.name === 'wait_activation' || e.name === 'wait_gradient'), 'pipeline wait span');
  // Spans on the training thread nest: one that starts in a step ends in it (1 us for the clock reads).
  for (const st of stepSpans) {
    const out = ev.find(e => e.cat === 'compute' && e !== st && e.ts >= st.ts && e.ts < st.ts + st.dur &&
                             e.ts + e.dur > st.ts + st.dur + 1);
    check(!out, `rank ${r}: ${out && out.name} starts in step ${st.args.step} and ends ${out && (out.ts + out.dur - st.ts - st.dur)} us after it`);
  }
});

// Rank 0's spans against its metrics.jsonl, step by step.
const metrics = {};
for (const line of fs.readFileSync(metricsPath, 'utf8').split('\n'))
  if (line.trim()) { const m = JSON.parse(line); if (m.step !== undefined) metrics[m.step] = m; }
const inside = (c, p) => c.ts >= p.ts - 0.01 && c.ts + c.dur <= p.ts + p.dur + 0.01;
const total = list => list.reduce((s, e) => s + e.dur, 0) / 1e3;  // ms
// The time of the spans named `names` less the spans named `nested` inside them.
const main0 = byRank[0] ? byRank[0].filter(e => e.cat === 'compute') : [];
const less = (within, names, nested) => {
  const outer = within.filter(e => names.includes(e.name));
  return total(outer) - total(within.filter(c => nested.includes(c.name) && outer.some(p => p !== c && inside(c, p))));
};
const TP = ['tp_all_reduce', 'tp_all_gather', 'tp_reduce_scatter'];
const CP = ['cp_all_gather', 'cp_reduce_scatter'];
let worst = { pct: 0, what: 'none' };
for (const s of steps) {
  const m = metrics[s];
  const step = main0.find(e => e.name === 'step' && e.args.step === s);
  if (!m || !step) { check(false, `rank 0: no metrics line or step span for step ${s}`); continue; }
  // The spans starting in the step (a span that ran past the step's end is caught below).
  const w = main0.filter(e => e !== step && e.ts >= step.ts && e.ts < step.ts + step.dur);
  check(w.filter(e => e.name === 'optimizer').length === 1, `step ${s}: rank 0 has no single optimizer span`);
  const tol = 0.05 * m.step_ms;
  const near = (what, spanMs, metricMs) => {
    const pct = 100 * Math.abs(spanMs - metricMs) / m.step_ms;
    if (pct > worst.pct) worst = { pct, what: `step ${s} ${what}` };
    check(Math.abs(spanMs - metricMs) <= tol,
          `step ${s}: ${what}: spans ${spanMs.toFixed(3)} ms, metrics ${metricMs.toFixed(3)} ms (tolerance ${tol.toFixed(3)} ms)`);
  };
  near('step', step.dur / 1e3, m.step_ms);
  const passes = w.filter(e => e.name === 'forward' || e.name === 'backward' || e.name === 'backward_weight');
  const tpInPasses = w.filter(c => TP.includes(c.name) && passes.some(p => inside(c, p)));
  const cpInPasses = w.filter(c => CP.includes(c.name) && passes.some(p => inside(c, p)));
  // backward_ms leaves out the gradient hook's tied reduction (a span) and bucket launches (not one).
  near('forward+backward less nested tp and tied', less(w, ['forward', 'backward', 'backward_weight'], [...TP, ...CP, 'tied_all_reduce']),
       m.forward_ms + m.backward_ms);
  near('tp collectives', total(tpInPasses), m.tp_comm_ms);
  near('cp collectives', total(cpInPasses), m.cp_comm_ms || 0);
  near('optimizer less nested dp_wait', less(w, ['optimizer'], ['dp_wait']), m.optimizer_ms);
  near('data_wait', total(w.filter(e => e.name === 'data_wait')), m.data_wait_ms);
  near('bubble: pipeline waits and drain less nested tied', less(w, ['wait_activation', 'wait_gradient', 'pipeline_drain'],
       ['tied_all_reduce']), m.pp_bubble_ms);
  near('exposed pp: wait_send and tied_all_reduce', total(w.filter(e => e.name === 'wait_send' || e.name === 'tied_all_reduce')),
       m.pp_comm_exposed_ms);
  near('checkpoint_save', total(w.filter(e => e.name === 'checkpoint_save')), m.ckpt_stall_ms);
}

if (failures.length) {
  for (const f of failures) console.log(`check failed: ${f}`);
  process.exit(1);
}
console.log(`ok: ${world} ranks, ${spans.length} spans, rank 0 agrees with metrics.jsonl on steps ${steps.join(', ')}` +
            ` (largest difference ${worst.pct.toFixed(2)}% of step_ms: ${worst.what})`);
