// Validates knapserve's Kubernetes deployment (deploy/kubernetes) and Grafana
// dashboards (deploy/grafana), the CTest test DeployManifests.
//
//   node tests/deploy/validate_manifests.mjs [DEPLOY_DIR]              # default: the repo's deploy/
//   node tests/deploy/validate_manifests.mjs --self-test [DEPLOY_DIR]
//
// For every overlay in DEPLOY_DIR/kubernetes/overlays (cpu and gpu must be
// there) it renders the overlay with `kubectl kustomize`, parses every
// document and validates each against its kind's schema: the Kubernetes 1.27
// OpenAPI schemas of the `kubernetes-models` package, and the Prometheus
// Operator CRD schemas of `@kubernetes-models/prometheus-operator` (versions
// pinned in package.json). A kind neither package knows is an error. Then it
// checks what the schemas cannot: the GPU overlay asks for nvidia.com/gpu,
// runs --device cuda on GPU nodes and tolerates their taint, the CPU overlay
// does none of that and sets --threads within its CPU request; Services, the
// PodDisruptionBudgets and the ServiceMonitor select the pods and ports they
// mean; the HPA scales the executor Deployment on knapserve_queued_requests;
// the dashboards ConfigMap holds every DEPLOY_DIR/grafana/*.json, each a
// dashboard with panels. Exit status 0 when all is well, 1 with the problems
// listed, 2 when it cannot run (no kubectl, no node_modules).
//
// --self-test also copies DEPLOY_DIR to a temporary folder, breaks the copy
// in one way per case (a Deployment with `replicas: "two"`, a container
// without a name, a GPU overlay without its toleration, ...) and runs this
// script on it: each broken copy must fail with the expected message, so the
// test cannot pass by checking nothing.
import { execFileSync, spawnSync } from 'node:child_process';
import { cpSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const REPO = resolve(HERE, '..', '..');

// The npm packages come from `npm ci` in tests/deploy (tools/setup.sh runs it).
if (!existsSync(join(HERE, 'node_modules', 'kubernetes-models'))) {
  console.error('validate_manifests: tests/deploy/node_modules is missing: tools/setup.sh installs it ' +
                '(cd tests/deploy && npm ci)');
  process.exit(2);
}
const { parseAllDocuments } = await import('yaml');

// ---------------------------------------------------------------- helpers

// Problems found, each a line naming the overlay and object.
class Problems {
  constructor() { this.list = []; }
  add(where, message) { this.list.push(`${where}: ${message}`); }
  check(condition, where, message) { if (!condition) this.add(where, message); return condition; }
}

const objectName = (o) => `${o?.kind ?? '?'}/${o?.metadata?.name ?? '?'}`;

// True when every key of `selector` (a plain label map) has the same value in
// `labels`. An empty selector selects nothing here: none of ours is empty.
function selects(selector, labels) {
  const keys = Object.keys(selector ?? {});
  return keys.length > 0 && keys.every((k) => (labels ?? {})[k] === selector[k]);
}

// A LabelSelector's matchLabels; matchExpressions are not used here, and a
// selector with them is reported rather than half-checked.
function matchLabels(selector, where, problems) {
  if (selector?.matchExpressions) problems.add(where, 'selector.matchExpressions is not supported by this check');
  return selector?.matchLabels ?? {};
}

// The value after `flag` in a container's args, or undefined.
function flagValue(args, flag) {
  const i = (args ?? []).indexOf(flag);
  return i >= 0 ? args[i + 1] : undefined;
}

// Cores of a CPU quantity ("4", 2, "500m").
function cores(quantity) {
  if (quantity === undefined) return undefined;
  const s = String(quantity);
  return s.endsWith('m') ? Number(s.slice(0, -1)) / 1000 : Number(s);
}

// The schema class for apiVersion/kind: kubernetes-models for the built-in
// groups, @kubernetes-models/prometheus-operator for monitoring.coreos.com.
// Only top-level resources count (their classes carry apiVersion and kind).
async function schemaFor(apiVersion, kind) {
  if (typeof apiVersion !== 'string' || typeof kind !== 'string') return undefined;
  const module = apiVersion.startsWith('monitoring.coreos.com/')
    ? `@kubernetes-models/prometheus-operator/${apiVersion}`
    : `kubernetes-models/${apiVersion}`;
  let models;
  try {
    models = await import(module);
  } catch {
    return undefined;
  }
  const model = models[kind];
  return model && model.apiVersion === apiVersion && model.kind === kind ? model : undefined;
}

function kustomize(dir) {
  const result = spawnSync('kubectl', ['kustomize', dir], { encoding: 'utf8', maxBuffer: 64 << 20 });
  if (result.error) throw result.error;
  return result;
}

// ---------------------------------------------------------------- checks

// Schema validation of every rendered document.
async function validateSchemas(where, objects, problems) {
  for (const o of objects) {
    const model = await schemaFor(o?.apiVersion, o?.kind);
    if (!model) {
      problems.add(where, `${objectName(o)}: unknown kind (apiVersion ${o?.apiVersion}): no schema for it in ` +
                          'kubernetes-models or @kubernetes-models/prometheus-operator');
      continue;
    }
    try {
      new model(o).validate();
    } catch (e) {
      const details = (e.errors ?? []).map((err) => `${err.instancePath || '/'} ${err.message}` +
        (err.params?.allowedValues ? ` ${JSON.stringify(err.params.allowedValues)}` : ''));
      problems.add(where, `${objectName(o)} does not match the ${o.apiVersion} ${o.kind} schema: ` +
                          (details.length ? details.join('; ') : e.message));
    }
  }
}

function find(objects, kind, name) {
  return objects.find((o) => o?.kind === kind && o?.metadata?.name === name);
}

// The Deployments, Services, PDBs, HPA and ServiceMonitor fit together.
function checkWiring(where, objects, problems) {
  const deployments = objects.filter((o) => o?.kind === 'Deployment');
  const services = objects.filter((o) => o?.kind === 'Service');
  for (const name of ['knapserve-executor', 'knapserve-planner']) {
    for (const kind of ['Deployment', 'Service', 'PodDisruptionBudget']) {
      problems.check(find(objects, kind, name), where, `${kind}/${name} is missing`);
    }
  }
  problems.check(find(objects, 'HorizontalPodAutoscaler', 'knapserve-executor'), where,
                 'HorizontalPodAutoscaler/knapserve-executor is missing');
  problems.check(objects.some((o) => o?.kind === 'ServiceMonitor'), where, 'no ServiceMonitor');

  for (const d of deployments) {
    const at = `${where}: ${objectName(d)}`;
    const podLabels = d.spec?.template?.metadata?.labels;
    problems.check(selects(matchLabels(d.spec?.selector, at, problems), podLabels), at,
                   'spec.selector does not match the pod template labels');
    const pod = d.spec?.template?.spec ?? {};
    for (const c of pod.containers ?? []) {
      const cat = `${at} container ${c.name}`;
      const requests = c.resources?.requests ?? {};
      const limits = c.resources?.limits ?? {};
      problems.check(requests.cpu !== undefined && requests.memory !== undefined, cat,
                     'needs resources.requests.cpu and .memory');
      problems.check(limits.memory !== undefined, cat, 'needs resources.limits.memory');
      // Flags and ports agree.
      const ports = Object.fromEntries((c.ports ?? []).map((p) => [p.name, p.containerPort]));
      const portOf = (flag) => { const v = flagValue(c.args, flag); return v && Number(v.split(':').pop()); };
      problems.check(portOf('--listen') === ports.grpc, cat, `--listen port is not the container port named grpc`);
      problems.check(portOf('--health-listen') === ports.health, cat, '--health-listen port is not the port named health');
      problems.check(c.readinessProbe?.grpc?.port === ports.health && c.livenessProbe?.grpc?.port === ports.health, cat,
                     'the gRPC probes must use the plaintext health port');
      problems.check(Number(flagValue(c.args, '--metrics-port')) === ports.metrics, cat,
                     '--metrics-port is not the container port named metrics');
      for (const flag of ['--tls-cert', '--tls-key', '--tls-ca']) {
        problems.check((flagValue(c.args, flag) ?? '').startsWith('/etc/knapserve/tls/'), cat, `${flag} must read /etc/knapserve/tls`);
      }
      if (d.metadata.name === 'knapserve-executor') {
        problems.check(flagValue(c.args, '--http-listen') === '0.0.0.0:8000' && ports.http === 8000, cat,
                       'the executor serves the OpenAI HTTP API: --http-listen 0.0.0.0:8000 and a port named http 8000');
      }
    }
    const volumes = Object.fromEntries((pod.volumes ?? []).map((v) => [v.name, v]));
    problems.check(volumes.tls?.secret?.secretName === 'knapserve-tls', at, 'the tls volume must be the Secret knapserve-tls');
    problems.check(volumes.models?.persistentVolumeClaim?.claimName === 'knapserve-models', at,
                   'the models volume must be the PVC knapserve-models');
  }

  // Each Service selects exactly one Deployment's pods, on ports they have.
  for (const s of services) {
    const at = `${where}: ${objectName(s)}`;
    const targets = deployments.filter((d) => selects(s.spec?.selector, d.spec?.template?.metadata?.labels));
    if (!problems.check(targets.length === 1, at, `selects the pods of ${targets.length} Deployments, not 1`)) continue;
    const named = new Set(targets[0].spec.template.spec.containers.flatMap((c) => (c.ports ?? []).map((p) => p.name)));
    for (const p of s.spec.ports ?? []) {
      problems.check(typeof p.targetPort !== 'string' || named.has(p.targetPort), at,
                     `port ${p.name}: targetPort ${p.targetPort} is no container port of ${objectName(targets[0])}`);
    }
  }

  // A PodDisruptionBudget for each Deployment, selecting its pods.
  for (const d of deployments) {
    const labels = d.spec?.template?.metadata?.labels;
    const pdbs = objects.filter((o) => o?.kind === 'PodDisruptionBudget' &&
      selects(matchLabels(o.spec?.selector, `${where}: ${objectName(o)}`, problems), labels));
    problems.check(pdbs.length === 1, where, `${objectName(d)}: ${pdbs.length} PodDisruptionBudgets select its pods, not 1`);
  }

  // The HPA scales the executor Deployment on the queue depth per pod.
  for (const h of objects.filter((o) => o?.kind === 'HorizontalPodAutoscaler')) {
    const at = `${where}: ${objectName(h)}`;
    const ref = h.spec?.scaleTargetRef ?? {};
    problems.check(ref.apiVersion === 'apps/v1' && ref.kind === 'Deployment' && ref.name === 'knapserve-executor', at,
                   `scaleTargetRef is ${ref.apiVersion} ${ref.kind} ${ref.name}, not apps/v1 Deployment knapserve-executor`);
    const target = find(objects, ref.kind, ref.name);
    problems.check(target, at, `scaleTargetRef ${ref.kind}/${ref.name} is not in the overlay`);
    problems.check(target?.spec?.replicas === undefined, at,
                   `${ref.kind}/${ref.name} sets spec.replicas: every apply would reset what the HPA scaled`);
    problems.check((h.spec?.metrics ?? []).some((m) => m.type === 'Pods' && m.pods?.metric?.name === 'knapserve_queued_requests'),
                   at, 'no Pods metric knapserve_queued_requests');
    problems.check(h.spec?.minReplicas <= h.spec?.maxReplicas, at, 'minReplicas > maxReplicas');
  }

  // The ServiceMonitor selects both Services, on their port named metrics.
  for (const m of objects.filter((o) => o?.kind === 'ServiceMonitor')) {
    const at = `${where}: ${objectName(m)}`;
    const selected = services.filter((s) => selects(matchLabels(m.spec?.selector, at, problems), s.metadata?.labels));
    for (const name of ['knapserve-executor', 'knapserve-planner']) {
      problems.check(selected.some((s) => s.metadata.name === name), at, `does not select Service/${name}`);
    }
    const endpointPorts = (m.spec?.endpoints ?? []).map((e) => e.port);
    problems.check(endpointPorts.includes('metrics'), at, 'no endpoint on the port named metrics');
    for (const s of selected) {
      const servicePorts = (s.spec?.ports ?? []).map((p) => p.name);
      for (const port of endpointPorts) {
        problems.check(servicePorts.includes(port), at, `endpoint port ${port} is not a port of ${objectName(s)}`);
      }
    }
  }
}

// GPU or CPU: what each overlay must and must not ask for.
function checkDevice(where, overlay, objects, problems) {
  for (const d of objects.filter((o) => o?.kind === 'Deployment')) {
    const at = `${where}: ${objectName(d)}`;
    const pod = d.spec?.template?.spec ?? {};
    const gpuTolerations = (pod.tolerations ?? []).filter((t) => t.key === 'nvidia.com/gpu');
    const gpuNodeSelector = Object.keys(pod.nodeSelector ?? {}).filter((k) => k.startsWith('nvidia.com/'));
    for (const c of pod.containers ?? []) {
      const cat = `${at} container ${c.name}`;
      const gpuLimit = c.resources?.limits?.['nvidia.com/gpu'];
      const gpuRequest = c.resources?.requests?.['nvidia.com/gpu'];
      const device = flagValue(c.args, '--device');
      if (overlay === 'gpu') {
        problems.check(Number(gpuLimit) >= 1, cat, 'the GPU overlay must set resources.limits nvidia.com/gpu');
        problems.check(gpuRequest === undefined || Number(gpuRequest) === Number(gpuLimit), cat,
                       'nvidia.com/gpu request and limit differ');
        problems.check(device?.startsWith('cuda'), cat, `--device is ${device}, not cuda`);
      } else if (overlay === 'cpu') {
        problems.check(gpuLimit === undefined && gpuRequest === undefined, cat, 'the CPU overlay must not ask for nvidia.com/gpu');
        problems.check(device === undefined || device === 'cpu', cat, `--device is ${device} in the CPU overlay`);
        const threads = Number(flagValue(c.args, '--threads'));
        problems.check(threads >= 1, cat, 'the CPU overlay must set --threads');
        problems.check(threads <= cores(c.resources?.requests?.cpu), cat,
                       `--threads ${threads} is more than the CPU request ${c.resources?.requests?.cpu}`);
      }
    }
    if (overlay === 'gpu') {
      problems.check(pod.nodeSelector?.['nvidia.com/gpu.present'] === 'true', at,
                     'the GPU overlay must select GPU nodes (nodeSelector nvidia.com/gpu.present: "true")');
      problems.check(gpuTolerations.some((t) => t.effect === 'NoSchedule' &&
                       (t.operator === 'Exists' || (t.operator ?? 'Equal') === 'Equal')), at,
                     'the GPU overlay must tolerate the nvidia.com/gpu NoSchedule taint');
    } else if (overlay === 'cpu') {
      problems.check(gpuTolerations.length === 0 && gpuNodeSelector.length === 0, at,
                     'the CPU overlay must not select or tolerate GPU nodes');
    }
  }
}

// The dashboards ConfigMap holds every grafana/*.json, each a dashboard.
function checkDashboards(where, objects, grafanaDir, problems) {
  const maps = objects.filter((o) => o?.kind === 'ConfigMap' && o.metadata?.labels?.grafana_dashboard === '1');
  if (!problems.check(maps.length === 1, where, `${maps.length} ConfigMaps labelled grafana_dashboard: "1", not 1`)) return;
  const data = maps[0].data ?? {};
  const at = `${where}: ${objectName(maps[0])}`;
  const files = readdirSync(grafanaDir).filter((f) => f.endsWith('.json')).sort();
  problems.check(files.length > 0, where, `no dashboards in ${grafanaDir}`);
  for (const f of files) {
    problems.check(f in data, at, `${f} is not in the ConfigMap (list it in ${join(grafanaDir, 'kustomization.yaml')})`);
  }
  // Client-side `kubectl apply` copies the object into an annotation limited to 256 KiB.
  const bytes = Object.values(data).reduce((n, text) => n + Buffer.byteLength(text), 0);
  problems.check(bytes < 256 * 1024, at, `the dashboards are ${bytes} bytes, over kubectl apply's 256 KiB annotation limit`);
  for (const [key, text] of Object.entries(data)) {
    const dat = `${at} ${key}`;
    let d;
    try {
      d = JSON.parse(text);
    } catch (e) {
      problems.add(dat, `not valid JSON: ${e.message}`);
      continue;
    }
    problems.check(typeof d.uid === 'string' && d.uid && typeof d.title === 'string' && d.title, dat, 'needs uid and title');
    problems.check(d.schemaVersion >= 36, dat, `schemaVersion ${d.schemaVersion} is below 36`);
    const variables = new Map((d.templating?.list ?? []).map((v) => [v.name, v]));
    problems.check(variables.get('datasource')?.type === 'datasource' && variables.get('datasource')?.query === 'prometheus',
                   dat, 'needs the Prometheus datasource variable ${datasource}');
    const panels = (d.panels ?? []).filter((p) => p.type !== 'row');
    problems.check(panels.length > 0, dat, 'has no panels');
    const ids = (d.panels ?? []).map((p) => p.id);
    problems.check(new Set(ids).size === ids.length, dat, 'panel ids are not unique');
    for (const p of panels) {
      const pat = `${dat} panel "${p.title}"`;
      const uid = p.datasource?.uid ?? '';
      const variable = /^\$\{(\w+)\}$/.exec(uid)?.[1];
      problems.check(variable && variables.get(variable)?.type === 'datasource', pat,
                     `datasource uid ${uid} is not one of the dashboard's datasource variables`);
      problems.check((p.targets ?? []).length > 0, pat, 'has no queries');
      for (const t of p.targets ?? []) {
        if (p.datasource?.type === 'prometheus') problems.check(typeof t.expr === 'string' && t.expr.trim(), pat, 'a target without expr');
        if (p.datasource?.type === 'tempo') problems.check(t.queryType === 'traceql' && t.query, pat, 'a Tempo target without a TraceQL query');
      }
    }
  }
}

// ---------------------------------------------------------------- main

async function validate(deployDir) {
  const problems = new Problems();
  const overlaysDir = join(deployDir, 'kubernetes', 'overlays');
  const grafanaDir = join(deployDir, 'grafana');
  const overlays = existsSync(overlaysDir)
    ? readdirSync(overlaysDir).filter((f) => statSync(join(overlaysDir, f)).isDirectory()).sort() : [];
  for (const needed of ['cpu', 'gpu']) {
    problems.check(overlays.includes(needed), deployDir, `overlay kubernetes/overlays/${needed} is missing`);
  }
  const summary = [];
  for (const overlay of overlays) {
    const where = `overlays/${overlay}`;
    const rendered = kustomize(join(overlaysDir, overlay));
    if (rendered.status !== 0) {
      problems.add(where, `kubectl kustomize failed: ${rendered.stderr.trim()}`);
      continue;
    }
    const objects = [];
    for (const doc of parseAllDocuments(rendered.stdout)) {
      for (const e of doc.errors) problems.add(where, `YAML: ${e.message}`);
      const o = doc.toJS();
      if (o !== null && o !== undefined) objects.push(o);
    }
    await validateSchemas(where, objects, problems);
    checkWiring(where, objects, problems);
    checkDevice(where, overlay, objects, problems);
    checkDashboards(where, objects, grafanaDir, problems);
    summary.push(`${where}: ${objects.length} objects (${objects.map(objectName).join(', ')})`);
  }
  return { problems: problems.list, summary };
}

// Broken copies the validator must refuse: [name, file under deploy/, from, to, expected message].
// `from` must occur exactly once in the file; to === null writes `from` as the whole new file.
const BREAKAGES = [
  ['replicas is a string', 'kubernetes/base/planner.yaml', 'replicas: 1', 'replicas: "two"', '/spec/replicas must be integer'],
  ['container without a name', 'kubernetes/base/executor.yaml', '        - name: executor\n          image:', '        - image:',
   "must have required property name"],
  ['a kind with no schema', 'kubernetes/base/kustomization.yaml', '  - servicemonitor.yaml\n',
   '  - servicemonitor.yaml\n  - frobnicator.yaml\n', 'unknown kind'],
  ['GPU overlay without its toleration', 'kubernetes/overlays/gpu/executor.yaml',
   '- op: add\n  path: /spec/template/spec/tolerations\n', '- op: add\n  path: /spec/template/spec/tolerationz\n',
   'must tolerate the nvidia.com/gpu NoSchedule taint'],
  ['GPU overlay without the GPU limit', 'kubernetes/overlays/gpu/planner.yaml', 'limits/nvidia.com~1gpu\n  value: 1',
   'limits/cpu\n  value: 1', 'must set resources.limits nvidia.com/gpu'],
  ['CPU overlay asking for a GPU', 'kubernetes/overlays/cpu/executor.yaml', '  path: /spec/template/spec/containers/0/resources/requests/cpu\n',
   '  path: /spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu\n  value: 1\n- op: add\n  path: /spec/template/spec/containers/0/resources/requests/cpu\n',
   'must not ask for nvidia.com/gpu'],
  ['HPA on the wrong Deployment', 'kubernetes/base/executor.yaml', '    kind: Deployment\n    name: knapserve-executor',
   '    kind: Deployment\n    name: knapserve-planner', 'not apps/v1 Deployment knapserve-executor'],
  ['PDB selecting no pods', 'kubernetes/base/planner.yaml', '  maxUnavailable: 1\n  selector:\n    matchLabels: {app: knapserve, component: planner}',
   '  maxUnavailable: 1\n  selector:\n    matchLabels: {app: knapserve, component: planer}', '0 PodDisruptionBudgets select its pods'],
  ['ServiceMonitor on a missing port', 'kubernetes/base/servicemonitor.yaml', '- port: metrics', '- port: prometheus',
   'no endpoint on the port named metrics'],
  ['a dashboard left out of the ConfigMap', 'grafana/knapserve-extra.json', '{"title": "extra", "panels": []}\n', null,
   'knapserve-extra.json is not in the ConfigMap'],
  ['a dashboard that is not JSON', 'grafana/knapserve-serving.json', '{"title": ', null, 'not valid JSON'],
  ['an overlay that does not render', 'kubernetes/overlays/cpu/kustomization.yaml', '  - ../../base', '  - ../../basis',
   'kubectl kustomize failed'],
];

function breakCopy(root, [name, file, from, to]) {
  const path = join(root, file);
  if (to === null) {
    writeFileSync(path, from);
  } else {
    const text = readFileSync(path, 'utf8');
    const count = text.split(from).length - 1;
    if (count !== 1) throw new Error(`self-test case "${name}": ${file} holds ${JSON.stringify(from)} ${count} times, not once`);
    writeFileSync(path, text.replace(from, to));
  }
  if (name === 'a kind with no schema') {
    writeFileSync(join(root, 'kubernetes/base/frobnicator.yaml'),
                  '# self-test\napiVersion: example.com/v1\nkind: Frobnicator\nmetadata: {name: f}\n');
  }
}

async function selfTest(deployDir) {
  let failed = 0;
  const work = mkdtempSync(join(tmpdir(), 'knapserve-deploy-'));
  try {
    for (const breakage of BREAKAGES) {
      const [name, , , , expected] = breakage;
      const root = join(work, String(BREAKAGES.indexOf(breakage)));
      cpSync(deployDir, root, { recursive: true });
      breakCopy(root, breakage);
      const run = spawnSync(process.execPath, [fileURLToPath(import.meta.url), root], { encoding: 'utf8' });
      const output = run.stdout + run.stderr;
      if (run.status === 1 && output.includes(expected)) {
        console.log(`self-test: ${name}: refused as it should be (${expected})`);
      } else {
        failed++;
        console.log(`self-test FAIL: ${name}: exit ${run.status}, expected exit 1 and "${expected}"; output:\n${output}`);
      }
    }
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
  return failed;
}

const args = process.argv.slice(2);
const withSelfTest = args[0] === '--self-test';
if (withSelfTest) args.shift();
if (args.length > 1 || args[0]?.startsWith('-')) {
  console.error('usage: validate_manifests.mjs [--self-test] [DEPLOY_DIR]');
  process.exit(2);
}
const deployDir = resolve(args[0] ?? join(REPO, 'deploy'));
try {
  execFileSync('kubectl', ['version', '--client'], { stdio: 'ignore' });
} catch {
  console.error('validate_manifests: kubectl (with its built-in kustomize) is not on PATH');
  process.exit(2);
}

const { problems, summary } = await validate(deployDir);
for (const line of summary) console.log(line);
if (problems.length) {
  console.log(`FAIL: ${problems.length} problem(s) in ${deployDir}:`);
  for (const p of problems) console.log(`  ${p}`);
  process.exit(1);
}
console.log(`OK: ${deployDir}: every overlay renders and every object matches its schema and checks`);
if (withSelfTest) {
  const failed = await selfTest(deployDir);
  if (failed) {
    console.log(`FAIL: ${failed} of ${BREAKAGES.length} broken copies were not refused`);
    process.exit(1);
  }
  console.log(`OK: all ${BREAKAGES.length} broken copies refused`);
}
