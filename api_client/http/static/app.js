// kiln's web page: a form that follows the chosen model's manifest, the caller's jobs (live over
// server-sent events), and the fleet's workers and queues. Plain ES2020, no build step; every
// call is to this gateway's JSON API with the page's session cookie.
"use strict";

const END_STATUSES = new Set(["finished", "failed", "stopped", "canceled", "quarantined"]);
const END_EVENTS = { done: "finished", failed: "failed", stopped: "stopped" };
const INPUT_MODES = {
  img2img: ["image"],
  inpaint: ["image", "mask"],
  edit: ["image"],
  upscale: ["image"], // an upscaler's one mode: the image, no prompt
  img2video: ["image"], // the first frame, resized to the video's size
};
const STRENGTH_MODES = new Set(["img2img", "inpaint"]); // edit denoises from noise: no strength
const UPLOAD_TYPES = new Set(["image/png", "image/jpeg", "image/webp"]);
// A video family makes frame_step * k + 1 frames: /v1/models says the step (ModelView.frame_step,
// from api_client/families.py), so the page keeps no family table of its own.
// The containers a model's kind makes (schema.py IMAGE_FORMATS, VIDEO_FORMATS): webp is an
// animated one for a video model.
const FORMATS = { image: ["png", "webp", "jpeg"], video: ["mp4", "webm", "webp"] };
// Each EventSource holds one of the browser's six HTTP/1.1 connections to this host: watch a
// few jobs live and poll the rest, so fetches never queue behind open streams.
const MAX_STREAMS = 3;
const FLEET_EVERY_MS = 4000;
const JOBS_EVERY_MS = 5000;
const REQUESTS_KEY = "kiln.requests"; // job id -> the request this page sent, for "render again"
const REQUESTS_KEPT = 200;

const form = document.getElementById("submit");
const jobsBox = document.getElementById("jobs");
const template = document.getElementById("job-template");
const state = {
  models: new Map(), // model id -> ModelView
  jobs: new Map(), // job id -> {view: JobView, request, card}
  streams: new Map(), // job id -> EventSource
  inputs: { image: null, mask: null }, // uploaded inputs not from the file inputs: {uri, text}
  sentLoras: [], // lora names in the order last sent: "loras.N.weight" errors name an index
  tick: 0,
  fleet: "", // the live workers' names: a change refreshes the model's hint at once
};

// ---- the JSON API ----

class HttpError extends Error {
  constructor(status, body) {
    super((body && (body.detail || body.title)) || `HTTP ${status}`);
    this.status = status;
    this.body = body || {};
  }
}

async function api(path, { method = "GET", json, body, type } = {}) {
  const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] = "application/json";
  } else if (body !== undefined) {
    init.body = body;
    init.headers["Content-Type"] = type;
  }
  const response = await fetch(path, init);
  const text = await response.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = { detail: text.slice(0, 300) };
    }
  }
  if (response.status === 401) signedOut();
  banner(response.status === 503 ? (data && data.detail) || "The gateway cannot reach Redis." : "");
  if (!response.ok) throw new HttpError(response.status, data);
  return data;
}

// One line across the top while the gateway cannot reach Redis (it answers 503), gone once it can.
function banner(text) {
  const box = document.getElementById("banner");
  box.hidden = !text;
  box.textContent = text ? `${text} Jobs already queued are kept; this page retries on its own.` : "";
}

function signedOut() {
  const box = document.getElementById("form-error");
  box.replaceChildren("Your session has ended. ", link("/", "Log in again"), ".");
  box.hidden = false;
}

// ---- small DOM helpers ----

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  node.append(...children);
  return node;
}

function jobUrl(id, tail = "") {
  return `/v1/jobs/${encodeURIComponent(id)}${tail}`;
}

function link(href, text) {
  return el("a", { href, text });
}

function seconds(value) {
  if (value === null || value === undefined) return "—";
  if (value < 10) return `${value.toFixed(1)} s`;
  if (value < 120) return `${Math.round(value)} s`;
  return `${Math.round(value / 60)} min`;
}

function clock(when) {
  const date = when instanceof Date ? when : new Date(when);
  return Number.isNaN(date.getTime()) ? "" : date.toLocaleTimeString();
}

function shown(value) {
  return typeof value === "string" ? JSON.stringify(value) : String(value);
}

// ---- models and the form that follows their manifests ----

function currentModel() {
  return state.models.get(form.elements.model.value) || null;
}

async function loadModels() {
  const { models } = await api("/v1/models");
  const select = form.elements.model;
  const wanted = select.value || localStorage.getItem("kiln.model");
  state.models = new Map(models.map((view) => [view.manifest.id, view]));
  if (!models.length) {
    select.replaceChildren(el("option", { value: "", text: "no models published" }));
    document.getElementById("model-hint").textContent =
      "No manifests are published: start a worker, or run `kiln manifests publish`.";
    return;
  }
  // Served models first: a first prompt to a model no worker serves would wait for one forever.
  const served = models.filter((view) => view.workers.length);
  const waiting = models.filter((view) => !view.workers.length);
  const option = (view) => el("option", { value: view.manifest.id, text: view.manifest.id });
  const group = (label, views) => el("optgroup", { label }, ...views.map(option));
  select.replaceChildren(
    ...[
      served.length ? group("served now", served) : null,
      waiting.length ? group("no worker serves it now", waiting) : null,
    ].filter(Boolean),
  );
  const usable = (id) =>
    state.models.has(id) && (!served.length || served.some((v) => v.manifest.id === id));
  select.value = usable(wanted) ? wanted : (served[0] || models[0]).manifest.id;
  applyManifest();
}

function modelHint() {
  const view = currentModel();
  const hint = document.getElementById("model-hint");
  if (!view) return;
  const parts = [view.manifest.family];
  if (!view.workers.length) parts.push("no worker serves it now: jobs wait until one starts");
  else parts.push(`${view.workers.length} worker${view.workers.length > 1 ? "s" : ""}`);
  if (view.resident_on.length) parts.push(`loaded on ${view.resident_on.join(", ")}`);
  const queued = Object.values(view.queued || {}).reduce((a, b) => a + b, 0);
  if (queued) parts.push(`${queued} queued`);
  if (view.eta_now_s !== null && view.eta_now_s !== undefined) {
    parts.push(`about ${seconds(view.eta_now_s)} now`);
  }
  for (const [worker, why] of Object.entries(view.blocked || {})) parts.push(`${worker}: ${why}`);
  hint.textContent = parts.join(" · ");
}

// A video model's manifest names its frames {default, max} and fps; an image model's names neither.
function isVideo(manifest) {
  return Boolean(manifest && manifest.frames);
}

function frameStep(view) {
  return view.frame_step || 1;
}

function setNumber(input, min, max, value) {
  input.min = String(min);
  input.max = String(max);
  input.value = String(value);
}

function applyManifest() {
  const view = currentModel();
  if (!view) return;
  const manifest = view.manifest;
  const f = form.elements;
  localStorage.setItem("kiln.model", manifest.id);
  setNumber(f.steps, 1, manifest.steps.max, manifest.steps.default);
  setNumber(f.guidance, 0, manifest.guidance.max, manifest.guidance.default);
  const trueCfg = document.getElementById("true_cfg-field");
  trueCfg.hidden = !manifest.true_cfg;
  f.true_cfg.value = "";
  if (manifest.true_cfg) f.true_cfg.max = String(manifest.true_cfg.max);

  const size = document.getElementById("f-size");
  size.replaceChildren(
    ...manifest.resolutions.map(([w, h]) =>
      el("option", { value: `${w}x${h}`, text: `${w} × ${h}` }),
    ),
  );
  syncSize();

  const video = isVideo(manifest);
  applyVideo(view, video);

  // The samplers the model takes (its manifest's, its family's where it names none).
  const samplers = manifest.samplers || [];
  document.getElementById("sampler-field").hidden = !samplers.length || video;
  const own = manifest.scheduler ? `its own (${manifest.scheduler})` : "its own";
  f.sampler.replaceChildren(
    el("option", { value: "", text: own }),
    ...samplers.map((name) => el("option", { value: name, text: name })),
  );
  syncSigmas();

  const mode = f.mode.value;
  f.mode.replaceChildren(...manifest.modes.map((m) => el("option", { value: m, text: m })));
  f.mode.value = manifest.modes.includes(mode) ? mode : manifest.modes[0];

  const loras = document.getElementById("loras");
  loras.replaceChildren(
    ...Object.entries(manifest.loras || {}).map(([name, spec]) => loraRow(name, spec)),
  );
  document.getElementById("loras-field").hidden = !Object.keys(manifest.loras || {}).length;

  // A step cache where the manifest declares one: auto, or the request's pin either way.
  document.getElementById("step_cache-field").hidden = !manifest.step_cache;
  f.step_cache.value = "";

  // A ControlNet where the manifest lists some; a hires pass where the model has img2img.
  const controls = Object.keys(manifest.controlnets || {});
  f.control_name.replaceChildren(
    el("option", { value: "", text: "none" }),
    ...controls.map((name) => el("option", { value: name, text: name })),
  );
  const offered = (yes) => (yes && !video ? "yes" : "");
  document.getElementById("controls-field").dataset.offered = offered(controls.length);
  // A reference image where the manifest names an IP-Adapter.
  document.getElementById("reference-field").dataset.offered = offered(manifest.ip_adapter);
  const upscalers = [...state.models.values()]
    .filter((other) => other.manifest.family === "upscaler")
    .map((other) => other.manifest.id);
  f.hires_upscaler.replaceChildren(
    el("option", { value: "latent", text: "its latents" }),
    ...upscalers.map((id) => el("option", { value: id, text: id })),
  );
  f.hires_scale.value = "";

  f.previews.checked = Boolean(manifest.taesd);
  f.previews.disabled = !manifest.taesd;
  document.getElementById("previews-hint").textContent = manifest.taesd
    ? "(TAESD, while denoising)"
    : "(this model names no TAESD)";
  updateModeFields();
  modelHint();
}

// A video model's form: frames on its family's rule (the browser refuses an off-rule count), its
// fps, the video containers, and one video a job (no number of images). An image model's: none
// of the video fields (disabled, so the browser neither checks nor sends them) and the image
// formats. The format picked is kept while the kind of model stays the same.
function applyVideo(view, video) {
  const f = form.elements;
  const manifest = view.manifest;
  document.getElementById("video-field").hidden = !video;
  document.getElementById("num_images-field").hidden = video;
  f.frames.disabled = f.fps.disabled = !video;
  f.num_images.disabled = video;
  if (video) {
    const step = frameStep(view);
    setNumber(f.frames, 1, manifest.frames.max, manifest.frames.default);
    f.frames.step = String(step);
    document.getElementById("frames-hint").textContent =
      `${step}k+1: 1, ${step + 1}, ${2 * step + 1}, … up to ${manifest.frames.max}`;
    f.fps.value = String(manifest.fps);
  }
  const kind = video ? "video" : "image";
  const select = f.output_format;
  const kept = select.dataset.kind === kind ? select.value : "";
  select.replaceChildren(...FORMATS[kind].map((name) => el("option", { value: name, text: name })));
  select.value = FORMATS[kind].includes(kept) ? kept : FORMATS[kind][0];
  select.dataset.kind = kind;
}

// The sigma schedules the chosen sampler takes on the model (the listing's sigmas); none without
// a sampler: the sampler's own schedule.
function syncSigmas() {
  const f = form.elements;
  const view = currentModel();
  const offered = (view && view.sigmas && view.sigmas[f.sampler.value]) || [];
  const kept = f.sigmas.value;
  f.sigmas.replaceChildren(
    el("option", { value: "", text: "the sampler's own" }),
    ...offered.map((name) => el("option", { value: name, text: name })),
  );
  f.sigmas.value = offered.includes(kept) ? kept : "";
  f.sigmas.disabled = !offered.length;
}

function loraRow(name, spec) {
  const id = `lora-${name}`;
  return el(
    "div",
    { class: "lora-row", "data-lora": name },
    el("input", { type: "checkbox", id, "data-lora": name }),
    el("label", { for: id, text: name }),
    el("label", { for: `${id}-weight`, class: "sr-only", text: `${name} weight` }),
    el("input", {
      type: "number",
      id: `${id}-weight`,
      class: "weight",
      "data-lora-weight": name,
      min: -4,
      max: 4,
      step: 0.05,
      value: spec.default_weight ?? 1,
    }),
    el("p", { class: "field-error", "data-error-for": `lora:${name}` }),
  );
}

function syncSize() {
  const [width, height] = document.getElementById("f-size").value.split("x");
  form.elements.width.value = width || "";
  form.elements.height.value = height || "";
}

function updateModeFields() {
  const f = form.elements;
  const mode = f.mode.value || "txt2img";
  const inputs = INPUT_MODES[mode] || [];
  document.getElementById("image-field").hidden = !inputs.includes("image");
  document.getElementById("mask-field").hidden = !inputs.includes("mask");
  document.getElementById("strength-field").hidden = !STRENGTH_MODES.has(mode);
  const firstFrame = mode === "img2video";
  document.getElementById("image-label").textContent = firstFrame ? "First frame" : "Input image";
  document.getElementById("image-hint").textContent = firstFrame
    ? "(resized to the video's size)"
    : "";
  // An upscale is the image alone: no prompt, sampling, size or seed (the image's size).
  const upscale = mode === "upscale";
  for (const part of form.querySelectorAll(".diffusion")) part.hidden = upscale;
  f.prompt.required = !upscale;
  const controls = document.getElementById("controls-field");
  controls.hidden = upscale || !controls.dataset.offered || mode === "edit";
  const reference = document.getElementById("reference-field");
  reference.hidden = upscale || !reference.dataset.offered || mode === "edit";
  const view = state.models.get(f.model.value);
  const modes = view ? view.manifest.modes : [];
  document.getElementById("hires-field").hidden = mode !== "txt2img" || !modes.includes("img2img");
}

function setInput(field, input) {
  state.inputs[field] = input;
  const note = document.querySelector(`[data-note-for="${field}"]`);
  note.hidden = !input;
  const thumb = note.querySelector("img");
  thumb.hidden = !(input && input.thumb);
  if (input && input.thumb) thumb.src = input.thumb;
  note.querySelector(".note-text").textContent = input ? input.text : "";
  if (input) form.elements[field].value = "";
}

// ---- building and sending a request ----

function number(input) {
  return input.value === "" ? undefined : Number(input.value);
}

async function upload(field, blob, name) {
  const type = blob.type;
  if (!UPLOAD_TYPES.has(type)) {
    const rule = "must be a PNG, JPEG or WebP image";
    const errors = [{ field, value: name, rule }];
    throw new HttpError(422, { title: "Upload refused", detail: rule, errors });
  }
  try {
    return (await api("/v1/uploads", { method: "POST", body: blob, type })).uri;
  } catch (err) {
    // An upload's refusal is about the file being sent, whatever field its words name.
    const errors = (err.body.errors || []).map((e) => ({ ...e, field }));
    if (!errors.length) errors.push({ field, value: name, rule: err.message });
    throw new HttpError(err.status, { ...err.body, errors });
  }
}

async function inputUri(field) {
  const file = form.elements[field].files[0];
  if (file) return upload(field, file, file.name);
  if (field === "mask" && painter.painted) return upload("mask", await paintedMask(), "painted mask");
  return state.inputs[field] ? state.inputs[field].uri : undefined;
}

// ---- the mask painter: white where the brush went (repainted), black elsewhere (kept) ----

const painter = { tool: "brush", painted: false, last: null, url: null };

function maskCanvas() {
  return document.getElementById("mask-canvas");
}

function imageSource() {
  const file = form.elements.image.files[0];
  if (file) return URL.createObjectURL(file);
  const input = state.inputs.image;
  return input && input.thumb ? input.thumb : null;
}

async function openPainter() {
  const source = imageSource();
  const error = document.getElementById("mask-error");
  if (!source) {
    error.textContent = "Choose the input image first: the mask is painted on it, at its size.";
    return;
  }
  error.replaceChildren();
  const image = document.getElementById("mask-image");
  image.src = source;
  await image.decode();
  const canvas = maskCanvas();
  canvas.width = image.naturalWidth;
  canvas.height = image.naturalHeight;
  clearMask();
  form.elements.mask.value = "";
  setInput("mask", null);
  document.getElementById("mask-painter").hidden = false;
}

function closePainter() {
  document.getElementById("mask-painter").hidden = true;
  painter.painted = false;
}

function clearMask() {
  const canvas = maskCanvas();
  canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
  painter.painted = false;
}

function stroke(event) {
  const canvas = maskCanvas();
  const box = canvas.getBoundingClientRect();
  const scale = canvas.width / box.width; // the canvas is the image's size, shown scaled
  const point = {
    x: (event.clientX - box.left) * scale,
    y: ((event.clientY - box.top) * canvas.height) / box.height,
  };
  const ctx = canvas.getContext("2d");
  ctx.globalCompositeOperation = painter.tool === "eraser" ? "destination-out" : "source-over";
  ctx.strokeStyle = ctx.fillStyle = "#ffffff";
  ctx.lineWidth = Number(document.getElementById("mask-size").value) * scale;
  ctx.lineCap = ctx.lineJoin = "round";
  ctx.beginPath();
  const from = painter.last || point;
  ctx.moveTo(from.x, from.y);
  ctx.lineTo(point.x, point.y);
  ctx.stroke();
  painter.last = point;
  if (painter.tool === "brush") painter.painted = true;
}

function paintedMask() {
  // The strokes are opaque white on a transparent canvas: laid on black, they are kiln's mask.
  const canvas = maskCanvas();
  const out = document.createElement("canvas");
  out.width = canvas.width;
  out.height = canvas.height;
  const ctx = out.getContext("2d");
  ctx.fillStyle = "#000000";
  ctx.fillRect(0, 0, out.width, out.height);
  ctx.drawImage(canvas, 0, 0);
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

function startPainter() {
  document.getElementById("mask-paint").addEventListener("click", () => openPainter().catch(failure));
  document.getElementById("mask-clear").addEventListener("click", clearMask);
  for (const button of document.querySelectorAll("[data-tool]")) {
    button.addEventListener("click", () => {
      painter.tool = button.dataset.tool;
      for (const other of document.querySelectorAll("[data-tool]")) {
        other.setAttribute("aria-pressed", String(other === button));
      }
    });
  }
  const canvas = maskCanvas();
  canvas.addEventListener("pointerdown", (event) => {
    canvas.setPointerCapture(event.pointerId);
    painter.last = null;
    stroke(event);
  });
  canvas.addEventListener("pointermove", (event) => {
    if (event.buttons) stroke(event);
  });
  canvas.addEventListener("pointerup", () => {
    painter.last = null;
  });
  // A new input image or an uploaded mask file replaces a painted mask (it was the old size).
  form.elements.image.addEventListener("change", closePainter);
  form.elements.mask.addEventListener("change", closePainter);
}

async function buildRequest() {
  const f = form.elements;
  const upscale = f.mode.value === "upscale";
  const request = { model: f.model.value };
  if (!upscale) request.prompt = f.prompt.value;
  if (f.negative_prompt.value && !upscale) request.negative_prompt = f.negative_prompt.value;
  const numbers = upscale ? [] : ["steps", "guidance", "width", "height", "seed"];
  // Disabled: not this model's (a video model's frames and fps, an image model's num_images).
  for (const name of [...numbers, "num_images", "frames", "fps"]) {
    const value = f[name].disabled ? undefined : number(f[name]);
    if (value !== undefined) request[name] = value;
  }
  if (!document.getElementById("true_cfg-field").hidden && f.true_cfg.value !== "") {
    request.true_cfg = Number(f.true_cfg.value);
  }
  const mode = f.mode.value || "txt2img";
  request.mode = mode;
  for (const field of INPUT_MODES[mode] || []) {
    const uri = await inputUri(field);
    if (uri) request[field] = uri;
  }
  if (STRENGTH_MODES.has(mode) && f.strength.value !== "") {
    request.strength = Number(f.strength.value);
  }
  const loras = [];
  for (const box of document.querySelectorAll("#loras input[type=checkbox]:checked")) {
    const name = box.dataset.lora;
    const weight = document.querySelector(`[data-lora-weight="${name}"]`).value;
    loras.push(weight === "" ? { name } : { name, weight: Number(weight) });
  }
  if (loras.length) request.loras = loras;
  if (!document.getElementById("step_cache-field").hidden && f.step_cache.value !== "") {
    request.step_cache = f.step_cache.value === "true";
  }
  if (!document.getElementById("sampler-field").hidden && f.sampler.value) {
    request.sampler = f.sampler.value;
    if (f.sigmas.value) request.sigmas = f.sigmas.value;
  }
  if (!document.getElementById("controls-field").hidden && f.control_name.value) {
    const file = f.control_image.files[0];
    const control = { name: f.control_name.value, strength: Number(f.control_strength.value) };
    if (file) control.image = await upload("controls", file, file.name);
    if (f.control_canny.checked) control.preprocess = "canny";
    request.controls = [control];
  }
  const referenceFile = f.reference_image.files[0];
  if (!document.getElementById("reference-field").hidden && referenceFile) {
    const image = await upload("reference", referenceFile, referenceFile.name);
    request.reference = { image, strength: Number(f.reference_strength.value) };
  }
  if (!document.getElementById("hires-field").hidden && f.hires_scale.value) {
    request.hires = { scale: Number(f.hires_scale.value), upscaler: f.hires_upscaler.value };
  }
  request.priority = f.priority.value;
  request.output_format = f.output_format.value;
  request.previews = f.previews.checked;
  return request;
}

async function submitRequest(request) {
  state.sentLoras = (request.loras || []).map((choice) => choice.name);
  const status = document.getElementById("submit-state");
  let created;
  try {
    created = await api("/v1/jobs", { method: "POST", json: request });
  } catch (err) {
    if (err.status === 422 && err.body.errors) {
      showErrors(err.body);
      status.textContent = "Refused: see the marked fields.";
      return null;
    }
    throw err;
  }
  remember(created.id, request);
  status.textContent = `Sent: job ${created.id.slice(0, 12)}`;
  const { id, urls } = created;
  const job = upsertJob({ id, status: created.status, model: request.model, urls });
  jobsBox.prepend(job.card);
  document.getElementById("jobs-empty").hidden = true;
  job.card.scrollIntoView({ block: "nearest" });
  watch(created.id);
  return created.id;
}

async function onSubmit(event) {
  event.preventDefault();
  clearErrors();
  const button = form.querySelector("button[type=submit]");
  button.disabled = true;
  document.getElementById("submit-state").textContent = "Sending…";
  try {
    await submitRequest(await buildRequest());
  } catch (err) {
    failure(err);
  } finally {
    button.disabled = false;
  }
}

// ---- refusals: each beside its field, the rest in the form's error box ----

function clearErrors() {
  for (const node of form.querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
  for (const node of form.querySelectorAll(".field-error")) node.replaceChildren();
  const box = document.getElementById("form-error");
  box.replaceChildren();
  box.hidden = true;
}

function errorTarget(field) {
  const f = form.elements;
  const sized = field === "width x height" || field === "width" || field === "height";
  if (sized) {
    return { inputs: [f.width, f.height, document.getElementById("f-size")], key: "width" };
  }
  const lora = /^loras\.(\d+)(?:\.(name|weight))?$/.exec(field);
  if (lora && state.sentLoras[Number(lora[1])] !== undefined) {
    const name = state.sentLoras[Number(lora[1])];
    const input = lora[2] === "weight"
      ? document.querySelector(`[data-lora-weight="${name}"]`)
      : document.querySelector(`#loras input[data-lora="${name}"]`);
    return { inputs: [input], key: `lora:${name}` };
  }
  if (field === "loras") {
    return { inputs: [...document.querySelectorAll("#loras input")], key: "loras" };
  }
  // controls.0.image, hires.scale, ...: the group's box, its inputs marked.
  for (const group of ["controls", "hires", "reference"]) {
    if (field === group || field.startsWith(`${group}.`)) {
      const inputs = [...form.querySelectorAll(`[name^="${group.replace(/s$/, "")}_"]`)];
      return { inputs, key: group };
    }
  }
  const input = f.namedItem(field);
  if (!input || !input.name || input.closest("[hidden]")) return null;
  return { inputs: [input], key: field };
}

function showErrors(problem) {
  const loose = [];
  for (const error of problem.errors || []) {
    const target = errorTarget(error.field);
    const box = target && form.querySelector(`[data-error-for~="${CSS.escape(target.key)}"]`);
    if (!box || box.closest("[hidden]")) {
      loose.push(error);
      continue;
    }
    for (const input of target.inputs) input.setAttribute("aria-invalid", "true");
    box.append(el("span", { class: "rule", text: errorWords(error) }));
  }
  if (loose.length || !(problem.errors || []).length) {
    const box = document.getElementById("form-error");
    box.append(el("p", { text: problem.detail || problem.title || "Refused." }));
    if (loose.length) {
      box.append(el("ul", {}, ...loose.map((e) => el("li", { text: errorWords(e) }))));
    }
    box.hidden = false;
  }
}

function errorWords({ field, value, rule }) {
  // The words RequestRejected uses: field=value: rule.
  if (value === null || value === undefined) return `${field}: ${rule}`;
  return `${field}=${shown(value)}: ${rule}`;
}

function failure(err) {
  document.getElementById("submit-state").textContent = "";
  if (err instanceof HttpError && err.status === 401) return; // signedOut() said so
  if (err instanceof HttpError && err.body.errors && err.body.errors.length) {
    showErrors(err.body);
    return;
  }
  const box = document.getElementById("form-error");
  const words = err instanceof HttpError
    ? `${err.body.title || `HTTP ${err.status}`}: ${err.message}`
    : `Could not reach the gateway: ${err.message}`;
  box.append(el("p", { text: words }));
  box.hidden = false;
}

// ---- jobs: one card each, kept current ----

function remembered() {
  try {
    return JSON.parse(localStorage.getItem(REQUESTS_KEY) || "{}");
  } catch {
    return {};
  }
}

function remember(id, request) {
  const kept = remembered();
  kept[id] = { request, at: Date.now() };
  const ids = Object.keys(kept).sort((a, b) => kept[b].at - kept[a].at);
  for (const old of ids.slice(REQUESTS_KEPT)) delete kept[old];
  localStorage.setItem(REQUESTS_KEY, JSON.stringify(kept));
}

function upsertJob(view) {
  let job = state.jobs.get(view.id);
  if (!job) {
    const card = template.content.firstElementChild.cloneNode(true);
    const kept = remembered()[view.id];
    job = { view, request: kept ? kept.request : null, at: kept ? kept.at : null, card, live: {} };
    card.dataset.jobId = view.id;
    card.querySelector(".cancel").addEventListener("click", () => act(cancel, view.id));
    card.querySelector(".again").addEventListener("click", () => act(renderAgain, view.id));
    card.querySelector(".as-input").addEventListener("click", () => act(useAsInput, view.id));
    card.querySelector(".to-form").addEventListener("click", () => toForm(view.id));
    state.jobs.set(view.id, job);
  } else {
    // An end seen on the stream is never undone by a read that raced it.
    const ended = END_STATUSES.has(job.view.status) && !END_STATUSES.has(view.status);
    job.view = { ...job.view, ...view, status: ended ? job.view.status : view.status };
  }
  if (END_STATUSES.has(job.view.status)) unwatch(view.id); // a cancel can end it with no event
  renderJob(job);
  return job;
}

function renderJob(job) {
  const { view, card } = job;
  const running = !END_STATUSES.has(view.status);
  card.dataset.status = view.status;
  const badge = card.querySelector(".status");
  badge.textContent = view.status;
  badge.className = `badge status status-${view.status}`;
  const model = view.model || (job.request && job.request.model) || "";
  card.querySelector(".job-model").textContent = model;
  const when = view.result ? view.result.finished_at : job.at;
  card.querySelector(".job-when").textContent = when ? clock(when) : "";
  const prompt = card.querySelector(".job-prompt");
  const sent = job.request || view.request; // the API returns the request, whoever submitted it
  prompt.textContent = sent ? sent.prompt || `(${sent.mode || "no prompt"})` : "prompt not known";
  prompt.classList.toggle("muted", !sent);

  card.querySelector(".job-live").hidden = !running;
  if (running) {
    const progress = { ...(view.progress || {}), ...job.live };
    let phase = view.status;
    if (view.status === "queued" && view.position !== null && view.position !== undefined) {
      phase = `queued · ${view.position} ahead`;
    }
    if (progress.phase) phase = progress.phase;
    if (progress.steps) phase += ` · step ${progress.step}/${progress.steps}`;
    if (view.eta_s !== null && view.eta_s !== undefined) phase += ` · ~${seconds(view.eta_s)}`;
    card.querySelector(".job-phase").textContent = phase;
    const bar = card.querySelector(".job-progress");
    // Never indeterminate: its endless animation costs a software-rendered browser a core.
    bar.value = progress.steps ? progress.step / progress.steps : 0;
  }
  const images = card.querySelector(".job-images");
  if (view.result && !images.childElementCount) {
    images.append(
      ...view.result.images.map((image, n) => finalImage(view, image, n)),
      ...(view.result.videos || []).map((video, n) => finalVideo(view, video, n)),
    );
  }
  const error = card.querySelector(".job-error");
  error.hidden = !view.error;
  error.textContent = view.error || "";
  const details = card.querySelector(".details");
  details.hidden = !view.result;
  if (view.result) details.replaceChildren(...detailRows(view.result));

  card.querySelector(".cancel").hidden = !running;
  card.querySelector(".again").hidden = running || !(job.request || view.result);
  card.querySelector(".as-input").hidden = !(view.result && view.result.images.length);
  card.querySelector(".to-form").hidden = running || !(job.request || view.result);
}

function fileUrl(id, file, n, kind) {
  // This gateway's path (never a protocol-relative //host) or S3's presigned https URL.
  const url = file.url || "";
  const ours = /^\/(?!\/)/.test(url) || url.startsWith(`${location.origin}/`);
  return ours || url.startsWith("https://") ? url : jobUrl(id, `/${kind}/${n}`);
}

function imageUrl(id, image, n) {
  return fileUrl(id, image, n, "images");
}

function finalImage(view, image, n) {
  const url = imageUrl(view.id, image, n);
  const img = el("img", {
    src: url,
    "data-job-id": view.id,
    alt: `image ${n + 1} of job ${view.id}`,
    width: image.width,
    height: image.height,
    loading: "lazy",
  });
  return el("a", { href: url, target: "_blank", rel: "noopener" }, img);
}

// A finished video plays in the card, looped and muted (these have no sound), when asked: a card
// never plays by itself. An animated webp plays in an <img>, as a link to its file as images are
// (a <video> is not wrapped in one: a click on its controls would follow the link).
function finalVideo(view, video, n) {
  const url = fileUrl(view.id, video, n, "videos");
  const label = `video ${n + 1} of job ${view.id}`;
  const size = { width: video.width, height: video.height };
  if (video.format === "webp") {
    const img = el("img", { src: url, "data-job-id": view.id, alt: label, ...size });
    return el("a", { href: url, target: "_blank", rel: "noopener" }, img);
  }
  const player = el("video", {
    src: url,
    "data-job-id": view.id,
    "aria-label": label,
    controls: true,
    loop: true,
    muted: true,
    playsinline: true,
    preload: "auto", // its first frame shown, not a blank box: a few MB at most
    ...size,
  });
  player.muted = true; // the attribute set after creation is only defaultMuted
  return player;
}

function detailRows(result) {
  const rows = [
    ["model", result.model],
    ["seed", result.seed],
    ["steps", result.steps],
    ["sampler", [result.sampler || "its own", result.sigmas].filter(Boolean).join(" · ")],
    ["guidance", result.guidance],
    ["size", `${result.width}×${result.height}`],
    ...(result.frames ? [["frames", `${result.frames} at ${result.fps} fps`]] : []),
    ["rung", result.rung],
    ["total", seconds(result.timings.total)],
    ["worker", result.worker],
  ];
  if (result.true_cfg !== null && result.true_cfg !== undefined) {
    rows.splice(4, 0, ["true cfg", result.true_cfg]);
  }
  const cache = result.step_cache;
  if (cache) {
    const steps = cache.steps_computed + cache.steps_reused;
    rows.splice(rows.length - 2, 0, ["step cache", `${cache.kind}: ${cache.steps_reused} of ${steps} reused`]);
  }
  return rows.flatMap(([name, value]) => [
    el("dt", { text: name }),
    el("dd", { "data-detail": name, text: String(value) }),
  ]);
}

function placeJobs(views) {
  // Newest first, as the gateway lists them; a card already on the page keeps its place.
  let previous = null;
  for (const view of views) {
    const job = upsertJob(view);
    if (!job.card.isConnected) {
      if (previous) previous.after(job.card);
      else jobsBox.prepend(job.card);
    }
    previous = job.card;
  }
  document.getElementById("jobs-empty").hidden = state.jobs.size > 0;
}

async function refreshJobs() {
  const { jobs } = await api("/v1/jobs?limit=20");
  placeJobs(jobs);
  for (const view of jobs) {
    if (!END_STATUSES.has(view.status)) watch(view.id);
    else unwatch(view.id);
  }
}

async function refreshJob(id, tries = 3) {
  const view = await api(jobUrl(id));
  const job = upsertJob(view);
  // The stream said it ended; the job record may lag by a moment behind it.
  const lagging = END_STATUSES.has(job.view.status) && !END_STATUSES.has(view.status);
  if ((lagging || (job.view.status === "finished" && !view.result)) && tries > 1) {
    setTimeout(() => refreshJob(id, tries - 1).catch(() => {}), 500);
  }
}

// ---- live: one EventSource per watched job ----

function watch(id) {
  if (state.streams.has(id) || state.streams.size >= MAX_STREAMS) return;
  const job = state.jobs.get(id);
  const url = (job && job.view.urls && job.view.urls.events) || jobUrl(id, "/events");
  const source = new EventSource(url);
  state.streams.set(id, source);
  const on = (kind, handle) =>
    source.addEventListener(kind, (message) => {
      let event = {};
      try {
        event = JSON.parse(message.data);
      } catch {
        return;
      }
      handle(event, message);
    });
  on("queued", () => liveStatus(id, "queued"));
  on("started", () => liveStatus(id, "started"));
  on("progress", (event) => liveProgress(id, event));
  on("preview", (event, message) => livePreview(id, event, message));
  for (const kind of Object.keys(END_EVENTS)) {
    on(kind, (event) => {
      unwatch(id); // closed here, or it reconnects and replays the end
      const ended = state.jobs.get(id);
      if (ended) {
        const error = event.error || ended.view.error;
        ended.view = { ...ended.view, status: END_EVENTS[kind], error };
        renderJob(ended);
      }
      refreshJob(id).catch(() => {});
    });
  }
  source.onerror = () => {
    // CONNECTING: it retries by itself with Last-Event-ID, unless the read below finds the job
    // ended (the stream closes without an end event for a job canceled in its queue).
    // CLOSED: refused (404, 401): the job is polled from here on.
    if (source.readyState === EventSource.CLOSED) unwatch(id);
    refreshJob(id).catch(() => {});
  };
}

function unwatch(id) {
  const source = state.streams.get(id);
  if (source) source.close();
  state.streams.delete(id);
  const card = state.jobs.get(id) && state.jobs.get(id).card;
  if (card) card.querySelector("[data-preview]").hidden = true;
}

function liveStatus(id, status) {
  const job = state.jobs.get(id);
  if (!job || END_STATUSES.has(job.view.status)) return;
  job.view = { ...job.view, status };
  renderJob(job);
}

function liveProgress(id, event) {
  const job = state.jobs.get(id);
  if (!job) return;
  job.live = { phase: event.phase, step: event.step || 0, steps: event.steps || 0 };
  if (!END_STATUSES.has(job.view.status)) job.view = { ...job.view, status: "started" };
  renderJob(job);
}

function livePreview(id, event, message) {
  const job = state.jobs.get(id);
  if (!job || END_STATUSES.has(job.view.status)) return;
  const img = job.card.querySelector("[data-preview]");
  const ref = event.preview || {};
  const bust = encodeURIComponent(message.lastEventId || event.id || Date.now());
  img.onload = () => {
    img.hidden = END_STATUSES.has(job.view.status);
  };
  img.src = ref.data
    ? `data:image/jpeg;base64,${ref.data}`
    : jobUrl(id, `/preview?v=${bust}`);
  if (event.step) liveProgress(id, { ...job.live, ...event });
}

// ---- a job's actions ----

async function act(action, id) {
  const box = document.getElementById("form-error");
  box.hidden = true;
  box.replaceChildren();
  try {
    await action(id);
  } catch (err) {
    failure(err);
  }
}

async function cancel(id) {
  const job = state.jobs.get(id);
  const url = (job.view.urls && job.view.urls.cancel) || jobUrl(id, "/cancel");
  job.card.querySelector(".cancel").disabled = true;
  try {
    await api(url, { method: "POST" });
  } finally {
    job.card.querySelector(".cancel").disabled = false;
  }
  await refreshJob(id);
}

function fromResult(view) {
  const result = view.result;
  const request = { model: result ? result.model : view.model };
  if (!result) return request;
  const shown = ["seed", "steps", "guidance", "width", "height", "true_cfg", "sampler", "sigmas"];
  shown.push("frames", "fps"); // a video's; null on an image's result, so left out
  for (const name of shown) {
    if (result[name] !== null && result[name] !== undefined) request[name] = result[name];
  }
  return request;
}

async function renderAgain(id) {
  const job = state.jobs.get(id);
  if (!job.request) {
    // Not sent from this page: its result says all but the prompt, which the form asks for.
    fillForm(fromResult(job.view));
    clearErrors();
    const box = document.getElementById("form-error");
    const words = `Job ${id} was not sent from this page, so its prompt is not known:`
      + " the form has its settings; type the prompt and render.";
    box.append(el("p", { text: words }));
    box.hidden = false;
    form.elements.prompt.focus();
    return;
  }
  const again = { ...job.request };
  if (job.view.result) again.seed = job.view.result.seed; // the same image, not a new random one
  clearErrors();
  await submitRequest(again);
}

function toForm(id) {
  const job = state.jobs.get(id);
  const request = { ...fromResult(job.view), ...(job.request || {}) };
  if (job.view.result) request.seed = job.view.result.seed;
  fillForm(request);
  form.scrollIntoView({ behavior: "smooth", block: "start" });
  form.elements.prompt.focus();
}

function fillForm(request) {
  const f = form.elements;
  if (request.model && state.models.has(request.model)) {
    f.model.value = request.model;
    applyManifest();
  }
  const manifest = currentModel() && currentModel().manifest;
  if (request.mode && manifest && manifest.modes.includes(request.mode)) {
    f.mode.value = request.mode;
  }
  updateModeFields();
  const fields = ["prompt", "negative_prompt", "steps", "guidance", "seed", "strength", "true_cfg"];
  for (const name of [...fields, "num_images", "frames", "fps"]) {
    if (request[name] !== undefined && request[name] !== null) f[name].value = String(request[name]);
  }
  if (request.priority) f.priority.value = request.priority;
  if (typeof request.step_cache === "boolean") f.step_cache.value = String(request.step_cache);
  if (request.output_format) f.output_format.value = request.output_format;
  if (request.sampler && [...f.sampler.options].some((o) => o.value === request.sampler)) {
    f.sampler.value = request.sampler;
    syncSigmas();
    if (request.sigmas && [...f.sigmas.options].some((o) => o.value === request.sigmas)) {
      f.sigmas.value = request.sigmas;
    }
  }
  if (request.previews !== undefined && !f.previews.disabled) f.previews.checked = request.previews;
  if (request.width && request.height) {
    const size = document.getElementById("f-size");
    const value = `${request.width}x${request.height}`;
    if ([...size.options].some((option) => option.value === value)) size.value = value;
    syncSize();
  }
  for (const choice of request.loras || []) {
    const box = document.querySelector(`#loras input[data-lora="${CSS.escape(choice.name)}"]`);
    if (!box) continue;
    box.checked = true;
    if (choice.weight !== undefined && choice.weight !== null) {
      const weight = document.querySelector(`[data-lora-weight="${CSS.escape(choice.name)}"]`);
      weight.value = String(choice.weight);
    }
  }
  for (const field of ["image", "mask"]) {
    setInput(field, request[field] ? { uri: request[field], text: "as that job had it" } : null);
  }
}

async function useAsInput(id) {
  const job = state.jobs.get(id);
  const manifest = currentModel() && currentModel().manifest;
  const modes = ["img2img", "edit", "inpaint", "img2video"];
  const mode = manifest && modes.find((m) => manifest.modes.includes(m));
  if (!mode) {
    throw new HttpError(422, {
      title: "No input image",
      detail: `model ${form.elements.model.value} takes no input image`
        + ` (modes: ${manifest ? manifest.modes.join(", ") : "none"}); pick another model first`,
    });
  }
  const response = await fetch(jobUrl(id, "/images/0"), { credentials: "same-origin" });
  if (!response.ok) {
    throw new HttpError(response.status, { detail: `could not read job ${id}'s image` });
  }
  const blob = await response.blob();
  const uri = await upload("image", blob, `job ${id} image 0`);
  form.elements.mode.value = mode;
  updateModeFields();
  const text = `job ${id.slice(0, 12)}'s image`;
  setInput("image", { uri, thumb: URL.createObjectURL(blob), text });
  form.scrollIntoView({ behavior: "smooth", block: "start" });
  form.elements.prompt.focus();
}

// ---- workers and queues, as `kiln top` shows them ----

function none(columns, text) {
  return el("tr", {}, el("td", { colspan: columns, class: "muted", text }));
}

function cells(...values) {
  return el("tr", {}, ...values.map((value) => el("td", { text: String(value) })));
}

async function refreshFleet() {
  const [{ workers }, { queues }] = await Promise.all([api("/v1/workers"), api("/v1/queues")]);
  const now = Date.now() / 1000;
  const workerRows = workers.map(({ state: worker, progress }) => {
    let job = worker.running ? worker.running.slice(0, 12) : "—";
    if (worker.running && progress) {
      job += ` ${progress.phase}${progress.steps ? ` ${progress.step}/${progress.steps}` : ""}`;
    }
    // RQ's enum as str() spells it ("WorkerStatus.BUSY"), shown as `kiln top` shows it.
    const word = worker.state.replace(/^WorkerStatus\./, "").toLowerCase();
    const status = worker.blocked ? `${word} (blocked: ${worker.blocked})` : word;
    return cells(
      worker.name,
      status,
      worker.device_name || worker.device,
      worker.resident.join(", ") || "—",
      job,
      worker.jobs_done,
      `${Math.max(0, Math.round(now - worker.heartbeat))} s ago`,
    );
  });
  document.querySelector("#workers tbody").replaceChildren(
    ...(workerRows.length ? workerRows : [none(7, "no live workers")]),
  );
  const queueRows = queues.map((q) =>
    cells(q.model, q.lane, q.depth, q.workers.length, seconds(q.eta_now_s)),
  );
  document.querySelector("#queues tbody").replaceChildren(
    ...(queueRows.length ? queueRows : [none(5, "no queues")]),
  );
  document.getElementById("fleet-updated").textContent = `updated ${clock(new Date())}`;
  const names = workers.map(({ state: worker }) => worker.name).join(" ");
  const changed = names !== state.fleet;
  state.fleet = names;
  return changed;
}

async function refreshModelHints() {
  const { models } = await api("/v1/models");
  for (const view of models) {
    if (state.models.has(view.manifest.id)) state.models.set(view.manifest.id, view);
  }
  modelHint();
}

// Repeats after each run ends (never two at once), skipping while the tab is hidden.
function every(ms, run) {
  const loop = async () => {
    if (!document.hidden) {
      try {
        await run();
      } catch {
        // shown where it matters (a 401 says so); the next round tries again
      }
    }
    setTimeout(loop, ms);
  };
  setTimeout(loop, ms);
}

// ---- start ----

function start() {
  const f = form.elements;
  form.addEventListener("submit", onSubmit);
  f.model.addEventListener("change", () => {
    clearErrors();
    applyManifest();
  });
  f.mode.addEventListener("change", updateModeFields);
  f.sampler.addEventListener("change", syncSigmas);
  document.getElementById("f-size").addEventListener("change", syncSize);
  for (const field of ["image", "mask"]) {
    f[field].addEventListener("change", () => {
      if (f[field].files.length) setInput(field, null);
    });
    const clear = document.querySelector(`[data-note-for="${field}"] .note-clear`);
    clear.addEventListener("click", () => setInput(field, null));
  }
  form.addEventListener("input", (event) => {
    const target = event.target;
    if (target.getAttribute && target.getAttribute("aria-invalid")) {
      target.removeAttribute("aria-invalid");
    }
  });
  document.getElementById("jobs-refresh").addEventListener("click", () => act(refreshJobs));
  startPainter();

  loadModels().catch(failure);
  refreshJobs().catch(failure);
  refreshFleet().catch(() => {});
  every(FLEET_EVERY_MS, async () => {
    state.tick += 1;
    const changed = await refreshFleet();
    if (changed || state.tick % 3 === 0) await refreshModelHints();
  });
  let rounds = 0;
  every(JOBS_EVERY_MS, async () => {
    rounds += 1;
    const unwatched = [...state.jobs.values()].some(
      (job) => !END_STATUSES.has(job.view.status) && !state.streams.has(job.view.id),
    );
    if (unwatched || rounds % 4 === 0) await refreshJobs(); // others' tabs add jobs too
  });
}

start();
