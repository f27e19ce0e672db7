// The Kubernetes manifests (deploy/k8s/) checked without a cluster.
//
//   node tests/deploy/k8s.mjs check SOURCE_DIR BIN_DIR
//       renders every overlay with `kubectl kustomize`, validates each object against the
//       Kubernetes OpenAPI schemas (the npm package kubernetes-models), unknown fields
//       rejected (unknownFields below), checks what the
//       deployment relies on (below), and checks deploy/docker-compose.yml and every overlay
//       against deploy/daemons.json and against the variables the binaries in BIN_DIR read.
//   node tests/deploy/k8s.mjs pods SOURCE_DIR OVERLAY NAMESPACE
//       prints, as JSON, the pods the overlay makes and how the kubelet starts their
//       containers and init containers (downward-API values filled in, $(VAR) references
//       expanded, volume mounts with their volumes' kinds), and the DNS
//       names the cluster's DNS gives them: what tests/cluster/k8s_netns_test.cc runs.
//
// The npm packages come from .cache/node (./dev install puts them there from
// tests/deploy/package.json); without them, or without kubectl, it exits 77 (skipped).
import { execFileSync, spawnSync } from "node:child_process";
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { pathToFileURL } from "node:url";

const SKIP = 77;
const [command, sourceDir, ...rest] = process.argv.slice(2);
const modules = path.resolve(process.env.TESSERA_NODE_MODULES || path.join(sourceDir ?? ".", ".cache/node/node_modules"));
const CLUSTER_DOMAIN = "cluster.local";

function skip(why) {
  console.log(`skipped: ${why}`);
  process.exit(SKIP);
}

if (!fs.existsSync(path.join(modules, "kubernetes-models")) || !fs.existsSync(path.join(modules, "yaml"))) {
  skip(`no kubernetes-models and yaml in ${modules} (./dev install puts them there)`);
}
try {
  execFileSync("kubectl", ["version", "--client"], { stdio: "ignore" });
} catch {
  skip("no kubectl on PATH");
}
const YAML = createRequire(path.join(modules, "/"))("yaml");

function render(overlay) {
  const text = execFileSync("kubectl", ["kustomize", overlay], { encoding: "utf8" });
  return YAML.parseAllDocuments(text).map((d) => d.toJS());
}

const overlaysDir = () => path.join(sourceDir, "deploy/k8s/overlays");
const overlays = () =>
  fs.readdirSync(overlaysDir()).filter((d) => fs.existsSync(path.join(overlaysDir(), d, "kustomization.yaml")));

// The workloads that make pods, and their pod templates.
const WORKLOADS = new Set(["Deployment", "StatefulSet", "Job"]);
const role = (o) => o.spec.template.metadata.labels["app.kubernetes.io/component"];

// A Kubernetes quantity ("1Gi", "512Mi", "1g" in compose) in bytes.
function bytes(q) {
  const m = /^([0-9]+)([A-Za-z]*)$/.exec(String(q));
  const units = { "": 1, k: 1e3, K: 1e3, M: 1e6, G: 1e9, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30 };
  const compose = { b: 1, k: 2 ** 10, m: 2 ** 20, g: 2 ** 30 };
  if (!m || (units[m[2]] === undefined && compose[m[2]] === undefined)) throw new Error(`not a quantity: ${q}`);
  return Number(m[1]) * (units[m[2]] ?? compose[m[2]]);
}

// A compose duration ("10s", "1m30s", "500ms") in milliseconds.
function milliseconds(d) {
  const units = { h: 3600e3, m: 60e3, s: 1e3, ms: 1, us: 1e-3 };
  const parts = [...String(d).matchAll(/([0-9.]+)(h|ms|us|m|s)/g)];
  if (parts.map((p) => p[0]).join("") !== String(d)) throw new Error(`not a duration: ${d}`);
  return parts.reduce((sum, p) => sum + Number(p[1]) * units[p[2]], 0);
}

// Expands $(VAR) as the kubelet does: only variables defined before; $$ escapes; others stay.
function expand(text, vars) {
  return String(text).replace(/\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (all, name) =>
    all === "$$" ? "$" : name in vars ? vars[name] : all,
  );
}

// The variables the binary reads: its --help names each ("env TESSERA_..."); and the default of
// each flag that names its variable (abseil's "(env TESSERA_X)); default: V;").
const helpCache = new Map();
function helpOf(bin) {
  if (helpCache.has(bin)) return helpCache.get(bin);
  // abseil's --help exits 1 after printing.
  const help = spawnSync(bin, ["--help"], { encoding: "utf8" }).stdout ?? "";
  if (!help.includes("Flags from")) throw new Error(`${bin} --help printed no flags`);
  const defaults = new Map();
  for (const flag of help.split(/\n\s*--(?=[a-z0-9_]+ \()/).slice(1)) {
    const variable = /\(env\s+(TESSERA_[A-Z0-9_]+)\)/.exec(flag)?.[1];
    const value = [...flag.matchAll(/\);\s+default:\s+(?:"([^"]*)"|([^;\s]*));/g)].at(-1);
    if (variable && value) defaults.set(variable, value[1] ?? value[2]);
  }
  // The worker's usage message gives its exit status after a drain on SIGTERM.
  const drained = /Exit status: (\d+)\b[^.;]* after a drain on SIGTERM/.exec(help)?.[1];
  helpCache.set(bin, {
    read: new Set([...help.matchAll(/\b(TESSERA_[A-Z0-9_]+)/g)].map((m) => m[1])),
    defaults,
    drainExitStatus: drained === undefined ? undefined : Number(drained),
  });
  return helpCache.get(bin);
}
const variablesRead = (bin) => helpOf(bin).read;

// What a worker's container must hold besides the device's buffers (--memory_bytes) and the
// freed buffers kept for reuse (--buffer_cache_bytes, which are no device's): the process
// itself, its code and libraries, gRPC's buffers, OpenBLAS's, thread stacks and the allocator's
// slack. 256 MiB is ASSUMED, not a bound anything enforces. Measured (RSS, this 2-core machine):
// 23 MiB idle; at most 42 MiB in bench_programs (docs/design.md, "Bounds"); but under
// example_transformer (dp on 2 workers, 30 steps, --buffer_cache_bytes=0) a worker reached
// 1.3-1.5 GiB with at most 369 MiB of device memory in use, still growing: memory glibc's
// allocator keeps, which a worker now gives back once idle (--heap_trim_freed_bytes), not while
// it trains (deploy/README.md, "Memory"). So the rule below is necessary, not sufficient.
const WORKER_PROCESS_BYTES = 256 * 2 ** 20;

// On SIGTERM (deploy/README.md, "Stopping") a worker drains: at most --drain_timeout_ms, the
// quiet period --drain_quiet_ms included (PlanRunner::wait_for_idle's deadline), counted again
// here to stay clear of it; then it stops heartbeating, which waits for a heartbeat in flight
// (its deadline: 4 heartbeat intervals, the coordinator's --heartbeat_interval_ms; worker/
// registration.cc), deregisters (a last heartbeat, its deadline 2 intervals:
// Registration::leave), and shuts its server down. The coordinator only shuts its server down.
// Each server's shutdown wait is a constant of its source, read from there; EXIT_MARGIN_MS is
// for the rest (threads joined, the process's exit, the signal's delivery). Measured exits:
// worker 0.32 s idle, coordinator 0.01 s (k8s_netns_test).
const HEARTBEATS_IN_FLIGHT = 4 + 2;
const EXIT_MARGIN_MS = 1000;
const SHUTDOWN_SOURCE = { coordinator: "coordinator/coordinator_server.cc", worker: "worker/worker_server.cc" };

// The fields of an object that its schema does not name. kubernetes-models' validators (ajv,
// compiled) accept them, as an API server without strict field validation does, so a misspelt
// field (`terminationGracePeriodSecond`) would pass and be dropped by the server. A validator
// reads every property its schema names, and enumerates the keys of a map (labels, limits);
// validating a copy whose objects record what is read shows the keys no schema looked at.
async function unknownFields(modelFile, object) {
  const source = fs.readFileSync(modelFile, "utf8");
  const schema = /import\{validate\}from"([^"]+)"/.exec(source)?.[1];
  if (!schema) throw new Error(`${modelFile} imports no schema validator`);
  const { validate } = await import(pathToFileURL(path.resolve(path.dirname(modelFile), schema)));
  const tracked = [];
  const track = (value, at) => {
    if (Array.isArray(value)) return value.map((v, i) => track(v, `${at}[${i}]`));
    if (value === null || typeof value !== "object") return value;
    const seen = { at, keys: Object.keys(value), read: new Set(), enumerated: false };
    tracked.push(seen);
    const copy = Object.fromEntries(Object.entries(value).map(([k, v]) => [k, track(v, at ? `${at}.${k}` : k)]));
    const note = (k) => typeof k === "string" && seen.read.add(k);
    return new Proxy(copy, {
      get: (t, k, receiver) => (note(k), Reflect.get(t, k, receiver)),
      has: (t, k) => (note(k), Reflect.has(t, k)),
      getOwnPropertyDescriptor: (t, k) => (note(k), Reflect.getOwnPropertyDescriptor(t, k)),
      ownKeys: (t) => ((seen.enumerated = true), Reflect.ownKeys(t)),
    });
  };
  validate(track(object, ""));  // its errors are the other pass's to report
  return tracked
    .filter((t) => !t.enumerated)
    .flatMap((t) => t.keys.filter((k) => !t.read.has(k)).map((k) => (t.at ? `${t.at}.${k}` : k)));
}

// What the Kubernetes OpenAPI schema (kubernetes-models) says is wrong with object `o`: its
// validator's errors, and every field the schema does not know.
async function schemaFailures(o) {
  const [group, version] = o.apiVersion.includes("/") ? o.apiVersion.split("/") : [null, o.apiVersion];
  const file = path.join(modules, "kubernetes-models", ...(group ? [group] : []), version, `${o.kind}.js`);
  if (!fs.existsSync(file)) return [`no schema for ${o.apiVersion} ${o.kind}`];
  const out = [];
  const Model = (await import(pathToFileURL(file)))[o.kind];
  try {
    new Model(o).validate();
  } catch (e) {
    out.push(`invalid: ${e.message}`);
  }
  for (const field of await unknownFields(file, o)) out.push(`unknown field ${field} (not in the ${o.apiVersion} ${o.kind} schema)`);
  return out;
}

// Every rule below, over rendered overlays ({name: objects}) and the parsed compose file;
// returns the failures, each naming the file or object and the rule. `binaries` overrides what
// the binaries' --help says (a broken variant of them: MUTATIONS).
async function failuresOf(rendered, compose, binDir, binaries = {}) {
  const failures = [];
  const fail = (where, what) => failures.push(`${where}: ${what}`);
  const description = JSON.parse(fs.readFileSync(path.join(sourceDir, "deploy/daemons.json"), "utf8"));
  const read = {};
  for (const r of ["coordinator", "worker"]) read[r] = variablesRead(path.join(binDir, description[r].binary));
  const everyRead = new Set([...read.coordinator, ...read.worker, ...variablesRead(path.join(binDir, "tessera"))]);

  // A setting of one container: its variable, or else the flag's default (the binary's --help).
  function setting(where, r, env, name) {
    const text = env[name] ?? helpOf(path.join(binDir, description[r].binary)).defaults.get(name);
    const value = Number(text);
    if (text === undefined || text === "" || !Number.isFinite(value)) fail(where, `${name} is ${JSON.stringify(text)}, not a number`);
    return value;
  }

  // The worker's container holds the device's buffers, the buffer cache and the process.
  function checkWorkerMemory(where, env, limitBytes) {
    const memory = setting(where, "worker", env, "TESSERA_WORKER_MEMORY_BYTES");
    const cache = setting(where, "worker", env, "TESSERA_WORKER_BUFFER_CACHE_BYTES");
    if (memory + cache + WORKER_PROCESS_BYTES > limitBytes) {
      fail(where, `--memory_bytes ${memory} + --buffer_cache_bytes ${cache} + ${WORKER_PROCESS_BYTES} for the ` +
                  `process itself is ${memory + cache + WORKER_PROCESS_BYTES} bytes, over the memory limit of ${limitBytes}`);
    }
  }

  // How long the daemon's gRPC server gives calls in flight when it shuts down (its source's
  // `server_->Shutdown(now + N)`): not a flag, so read where it is set.
  const shutdownWaits = {};
  function shutdownWaitMs(r) {
    return (shutdownWaits[r] ??= readShutdownWaitMs(r));
  }
  function readShutdownWaitMs(r) {
    const file = SHUTDOWN_SOURCE[r];
    const text = fs.readFileSync(path.join(sourceDir, file), "utf8");
    const found = [...text.matchAll(/server_->Shutdown\(std::chrono::system_clock::now\(\) \+ std::chrono::(seconds|milliseconds)\((\d+)\)\)/g)];
    if (found.length !== 1) {
      fail(file, `${found.length} server shutdowns of the form server_->Shutdown(now + N), not one: the grace period rule needs it`);
      return NaN;
    }
    return Number(found[0][2]) * (found[0][1] === "seconds" ? 1000 : 1);
  }

  // The grace period (the kubelet's, or docker's stop_grace_period) covers the daemon's stop.
  function checkGrace(where, r, env, coordinatorEnv, graceMs) {
    const server = shutdownWaitMs(r);
    if (r === "coordinator") {
      if (!(graceMs >= server + EXIT_MARGIN_MS)) {
        fail(where, `grace period ${graceMs / 1000} s is shorter than its shutdown: the server's ${server} ms + ${EXIT_MARGIN_MS} ms to exit`);
      }
      return;
    }
    const timeout = setting(where, "worker", env, "TESSERA_WORKER_DRAIN_TIMEOUT_MS");
    const quiet = setting(where, "worker", env, "TESSERA_WORKER_DRAIN_QUIET_MS");
    const heartbeat = HEARTBEATS_IN_FLIGHT * setting(where, "coordinator", coordinatorEnv, "TESSERA_COORDINATOR_HEARTBEAT_INTERVAL_MS");
    const need = timeout + quiet + heartbeat + server + EXIT_MARGIN_MS;
    if (!(graceMs >= need)) {
      fail(where, `grace period ${graceMs / 1000} s is shorter than the drain and stop: --drain_timeout_ms ${timeout} + ` +
                  `--drain_quiet_ms ${quiet} + a heartbeat in flight and the deregistration ${heartbeat} + the server's ${server} + ${EXIT_MARGIN_MS} ms to exit = ${need} ms`);
    }
  }

  // Each daemon sees only its own credentials (docs/design.md, "Security"): an init container
  // mounts the Secret and copies this pod's files (`tessera select-credentials`) into an
  // in-memory emptyDir, which the daemon mounts read-only; no daemon container mounts the Secret.
  function checkCredentials(where, o, r, env) {
    const pod = o.spec.template.spec;
    const volumeOf = (m) => pod.volumes?.find((v) => v.name === m?.name);
    for (const c of pod.containers) {
      for (const m of c.volumeMounts ?? []) {
        const v = volumeOf(m);
        const secrets = [v?.secret?.secretName, ...(v?.projected?.sources ?? []).map((s) => s.secret?.name)].filter(Boolean);
        if (secrets.length > 0) {
          fail(where, `container ${c.name} mounts the Secret ${secrets.join(", ")} (volume ${m.name} at ${m.mountPath}): ` +
                      "every device's key and the admin token; only the init container may");
        }
      }
    }
    const c = pod.containers[0];
    const mount = c.volumeMounts?.find((m) => m.mountPath === "/etc/tessera/credentials");
    const volume = volumeOf(mount);
    if (!mount?.readOnly || volume?.emptyDir?.medium !== "Memory") {
      fail(where, "needs its credentials read-only at /etc/tessera/credentials from an in-memory emptyDir (medium Memory)");
    }
    const inits = (pod.initContainers ?? []).filter((i) => JSON.stringify(i.command?.slice(0, 2)) === '["tessera","select-credentials"]');
    if (inits.length !== 1) {
      fail(where, "needs one init container running `tessera select-credentials` into the credentials volume");
      return;
    }
    const init = inits[0];
    const args = [...init.command.slice(2), ...(init.args ?? [])];
    if (!args.includes(`--role=${r}`)) fail(where, `the init container must select the ${r}'s files (--role=${r})`);
    if (r === "worker" && !args.includes(`--device_id_from=${env.TESSERA_WORKER_DEVICE_ID_FROM}`)) {
      fail(where, `the init container's device must be the worker's: --device_id_from=${env.TESSERA_WORKER_DEVICE_ID_FROM}`);
    }
    const [from, to] = args.filter((a) => !a.startsWith("--"));
    const fromMount = init.volumeMounts?.find((m) => m.mountPath === from);
    const toMount = init.volumeMounts?.find((m) => m.mountPath === to);
    const secret = volumeOf(fromMount)?.secret;
    if (!fromMount?.readOnly || secret?.secretName !== "tessera-credentials") {
      fail(where, `the init container must read Secret tessera-credentials mounted read-only at ${from}`);
    }
    // A missing Secret must stop the pod, never start a daemon that checks nothing.
    if (secret?.optional !== false) fail(where, "the credentials Secret must be required (optional: false)");
    if (!toMount || toMount.name !== mount?.name) fail(where, `the init container must write ${to} into the volume the daemon mounts (${mount?.name})`);
  }

  // A worker stopped by SIGTERM (its pod deleted, evicted or preempted) drains and exits with the
  // status its --help gives. A pod whose containers all exit 0 and are not restarted is
  // Succeeded, and a Job counts it as a completion, an Indexed Job's index as done: never run
  // again (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle, "Pod phase"; /controllers/job).
  // So in a Job the status must be non-zero, and no pod failure policy rule may end the index or
  // the Job on it, or on the DisruptionTarget condition an eviction or preemption sets
  // (/docs/tasks/job/pod-failure-policy); the API server accepts a podFailurePolicy only with
  // restartPolicy Never (JobSpec.podFailurePolicy), which the schema does not say. And the
  // replacement waits until the old pod has exited (podReplacementPolicy Failed; the default,
  // TerminatingOrFailed, starts it while the old one drains: two workers under one device id
  // and one DNS name, kubernetes.io/blog/2025/09/05, "Pod Replacement Policy for Jobs").
  function checkJobRestarts(where, job) {
    const pod = job.spec.template.spec;
    const binary = description.worker.binary;
    const status = binaries.drainExitStatus ?? helpOf(path.join(binDir, binary)).drainExitStatus;
    if (!["OnFailure", "Never"].includes(pod.restartPolicy)) {
      fail(where, `restartPolicy ${pod.restartPolicy}: a Job's pods need OnFailure or Never`);
    }
    if (status === undefined) fail(where, `${binary} --help gives no exit status after a drain on SIGTERM`);
    else if (status === 0) {
      fail(where, `${binary} exits 0 after a drain on SIGTERM: an evicted or deleted worker's pod would succeed ` +
                  "and the Job count its index as complete, never replaced");
    }
    if (job.spec.podReplacementPolicy !== "Failed") {
      fail(where, `podReplacementPolicy ${job.spec.podReplacementPolicy ?? "TerminatingOrFailed (the default)"}: ` +
                  "an index's new pod would start while the old one drains; it must be Failed");
    }
    const rules = job.spec.podFailurePolicy?.rules ?? [];
    if (rules.length > 0 && pod.restartPolicy !== "Never") {
      fail(where, `a podFailurePolicy needs restartPolicy Never, not ${pod.restartPolicy} (the API server refuses it)`);
    }
    for (const [i, rule] of rules.entries()) {
      if (rule.action !== "FailJob" && rule.action !== "FailIndex") continue;
      const codes = rule.onExitCodes;
      const onStatus = codes && (codes.containerName ?? pod.containers[0].name) === pod.containers[0].name &&
                       (codes.operator === "In") === codes.values.includes(status);
      const onDisruption = (rule.onPodConditions ?? []).some((c) => c.type === "DisruptionTarget" && (c.status ?? "True") === "True");
      if (onStatus || onDisruption) {
        fail(where, `podFailurePolicy rule ${i} (${rule.action}) matches a worker stopped by SIGTERM ` +
                    `(${onStatus ? `exit status ${status}` : "DisruptionTarget"}): its index would never run again`);
      }
    }
  }

  // The TESSERA_ variables of one container against the description.
  function checkEnv(where, r, target, env) {
    const d = description[r];
    const values = { ...d.env, ...(d.env_by_target?.[target] ?? {}) };
    const expected = new Set([...Object.keys(values), ...d.identity[target]]);
    for (const [name, value] of Object.entries(values)) {
      if (env[name] !== value) fail(where, `${name} is ${JSON.stringify(env[name])}, deploy/daemons.json says "${value}"`);
    }
    for (const name of Object.keys(env).filter((n) => n.startsWith("TESSERA_"))) {
      if (!read[r].has(name)) fail(where, `${name} is read by no flag of ${d.binary} (see its --help)`);
      if (!expected.has(name)) fail(where, `${name} is not in deploy/daemons.json (env or identity.${target})`);
    }
    for (const name of expected) if (!(name in env)) fail(where, `${name} is missing`);
  }

  for (const [overlay, docs] of Object.entries(rendered)) {
    const workloads = {}, stopping = {};
    for (const o of docs) {
      const where = `${overlay}: ${o.kind} ${o.metadata?.name}`;
      for (const f of await schemaFailures(o)) fail(where, f);
      if (o.metadata?.labels?.["app.kubernetes.io/part-of"] !== "tessera") fail(where, "no part-of label");
      if (o.kind === "Service") {
        const headless = o.spec.clusterIP === "None";
        if (headless && o.spec.publishNotReadyAddresses !== true) {
          fail(where, "a headless Service for discovery needs publishNotReadyAddresses (names resolve before ready)");
        }
        // Service links: a Service with a cluster IP puts NAME_SERVICE_HOST, NAME_PORT, ... into
        // pods that keep them on; none may be a variable a Tessera program reads.
        const prefix = o.metadata.name.toUpperCase().replace(/-/g, "_");
        for (const v of everyRead) {
          if (!headless && (v === `${prefix}_PORT` || v.startsWith(`${prefix}_PORT_`) || v.startsWith(`${prefix}_SERVICE_`))) {
            fail(where, `its service-link variables would set ${v}`);
          }
        }
      }
      if (!WORKLOADS.has(o.kind)) continue;
      const r = role(o);
      if (!(r in description)) {
        fail(where, `component label '${r}' is neither coordinator nor worker`);
        continue;
      }
      workloads[r] = o;
      const pod = o.spec.template.spec;
      if (pod.enableServiceLinks !== false) fail(where, "enableServiceLinks must be false");
      if (pod.automountServiceAccountToken !== false) fail(where, "automountServiceAccountToken must be false");
      if (pod.securityContext?.runAsNonRoot !== true || !(pod.securityContext?.runAsUser > 0)) {
        fail(where, "must run as non-root (runAsNonRoot, runAsUser > 0)");
      }
      if (!(pod.terminationGracePeriodSeconds > 0)) fail(where, "needs terminationGracePeriodSeconds");
      if (pod.containers.length !== 1) fail(where, "one container per pod");
      const c = pod.containers[0];
      const d = description[r];
      if (JSON.stringify(c.command) !== JSON.stringify([d.binary])) fail(where, `command must be ["${d.binary}"]`);
      const sc = c.securityContext ?? {};
      if (sc.readOnlyRootFilesystem !== true) fail(where, "readOnlyRootFilesystem must be true");
      if (sc.allowPrivilegeEscalation !== false) fail(where, "allowPrivilegeEscalation must be false");
      if (!sc.capabilities?.drop?.includes("ALL")) fail(where, "capabilities must drop ALL");
      const port = c.ports?.find((p) => p.name === "grpc")?.containerPort;
      if (port !== d.port) fail(where, `port grpc is ${port}, deploy/daemons.json says ${d.port}`);
      for (const [probe, service] of [["startupProbe", "liveness"], ["livenessProbe", "liveness"], ["readinessProbe", ""]]) {
        const g = c[probe]?.grpc;
        // On the plaintext health port: the main one may serve TLS only, which the kubelet cannot probe.
        if (!g || g.port !== d.health_port || (g.service ?? "") !== service) {
          fail(where, `${probe} must be grpc on the health port ${d.health_port}, service '${service}' (grpc.health.v1)`);
        }
      }
      // Prometheus finds the metrics port by the pod's annotations (and a PodMonitor by its name).
      const annotations = o.spec.template.metadata?.annotations ?? {};
      const metrics = c.ports?.find((p) => p.name === "metrics")?.containerPort;
      if (metrics !== d.metrics_port) fail(where, `port metrics is ${metrics}, deploy/daemons.json says ${d.metrics_port}`);
      if (annotations["prometheus.io/scrape"] !== "true" || annotations["prometheus.io/port"] !== String(d.metrics_port) ||
          annotations["prometheus.io/path"] !== "/metrics") {
        fail(where, `needs the annotations prometheus.io/scrape "true", prometheus.io/port "${d.metrics_port}", prometheus.io/path /metrics`);
      }
      const limit = c.resources?.limits?.memory, request = c.resources?.requests?.memory;
      if (!limit || bytes(limit) !== d.memory_limit_bytes) fail(where, `memory limit ${limit} is not ${d.memory_limit_bytes} bytes`);
      if (!request || bytes(request) !== bytes(limit)) fail(where, `memory request ${request} must equal the limit`);
      // Every $(VAR) must name a variable defined before it, or the kubelet leaves it as is.
      const env = {}, defined = {};
      for (const e of c.env ?? []) {
        if (e.value !== undefined) {
          for (const m of String(e.value).matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
            if (!(m[1] in defined)) fail(where, `${e.name} refers to $(${m[1]}), not defined before it`);
          }
        }
        defined[e.name] = true;
        env[e.name] = e.value;
      }
      checkEnv(where, r, "k8s", env);
      checkCredentials(where, o, r, env);
      stopping[r] = { where, env, graceMs: (pod.terminationGracePeriodSeconds ?? 30) * 1000 };
      if (r === "worker") {
        if (limit) checkWorkerMemory(where, env, bytes(limit));
        const count = o.kind === "StatefulSet" ? o.spec.replicas : o.spec.completions;
        if (count !== description.workers) fail(where, `${count} workers, deploy/daemons.json says ${description.workers}`);
        if (o.kind === "Job" && (o.spec.parallelism !== count || o.spec.completionMode !== "Indexed")) {
          fail(where, "an Indexed Job with parallelism = completions");
        }
        if (o.kind === "Job") checkJobRestarts(where, o);
        if (o.kind === "StatefulSet" && o.spec.podManagementPolicy !== "Parallel") fail(where, "podManagementPolicy Parallel");
      }
    }
    for (const r of ["coordinator", "worker"]) if (!workloads[r]) fail(overlay, `no ${r} workload`);
    for (const [r, { where, env, graceMs }] of Object.entries(stopping)) {
      checkGrace(where, r, env, stopping.coordinator?.env ?? {}, graceMs);
    }
    const expected = workloads.coordinator?.spec.template.spec.containers[0].env.find(
      (e) => e.name === "TESSERA_COORDINATOR_EXPECTED_DEVICES",
    )?.value;
    if (Number(expected) !== description.workers) fail(overlay, `the coordinator expects ${expected} devices`);
  }

  // docker-compose.yml against the same description.
  let composeWorkers = 0;
  for (const [name, s] of Object.entries(compose.services)) {
    const r = name === "coordinator" ? "coordinator" : name.startsWith("worker-") ? "worker" : null;
    if (!r) continue;
    if (r === "worker") ++composeWorkers;
    const where = `docker-compose.yml: ${name}`;
    if (JSON.stringify(s.command) !== JSON.stringify([description[r].binary])) fail(where, "wrong command");
    if (bytes(s.mem_limit) !== description[r].memory_limit_bytes) fail(where, `mem_limit ${s.mem_limit}`);
    if (s.read_only !== true) fail(where, "read_only must be true (a read-only root, as readOnlyRootFilesystem)");
    checkEnv(where, r, "compose", s.environment);
    if (r === "worker") checkWorkerMemory(where, s.environment, bytes(s.mem_limit));
    // Docker's default grace is 10 s.
    checkGrace(where, r, s.environment, compose.services.coordinator?.environment ?? {}, milliseconds(s.stop_grace_period ?? "10s"));
    if (r === "worker" && s.environment.TESSERA_WORKER_DEVICE_ID !== name.slice(7)) fail(where, "device id != its number");
  }
  if (composeWorkers !== description.workers) fail("docker-compose.yml", `${composeWorkers} workers`);
  return failures;
}

// Breaking the manifests in ways the rules are there for; each must be caught, naming it.
const MUTATIONS = [
  ["a field of the wrong type", (r) => (container(r, "worker").ports[0].containerPort = "6000"), "must be integer"],
  ["a writable root filesystem", (r) => delete container(r, "worker").securityContext.readOnlyRootFilesystem, "readOnlyRootFilesystem"],
  ["root", (r) => (workload(r, "coordinator").spec.template.spec.securityContext.runAsUser = 0), "non-root"],
  ["a memory limit off the description", (r) => (container(r, "worker").resources.limits.memory = "2Gi"), "memory limit"],
  ["a value off the description", (r) => (envVar(r, "worker", "TESSERA_WORKER_PORT").value = "6001"), "TESSERA_WORKER_PORT"],
  ["a variable no binary reads", (r) => container(r, "worker").env.push({ name: "TESSERA_WORKER_PROT", value: "1" }), "read by no flag"],
  ["a reference to a later variable", (r) => container(r, "worker").env.unshift({ name: "X", value: "$(POD_NAME)" }), "not defined before"],
  ["a probe on the TLS port", (r) => (container(r, "worker").livenessProbe.grpc.port = 6000), "livenessProbe must be grpc on the health port"],
  ["a scrape annotation off the metrics port", (r) => (workload(r, "worker").spec.template.metadata.annotations["prometheus.io/port"] = "6001"), "prometheus.io/port"],
  ["an HTTP probe", (r) => (container(r, "coordinator").readinessProbe = { httpGet: { port: 5000 } }), "readinessProbe"],
  ["a discovery Service hiding pods", (r) => delete service(r, "tessera-workers").spec.publishNotReadyAddresses, "publishNotReadyAddresses"],
  ["a Service whose links set TESSERA_COORDINATOR_PORT", (r) => delete service(r, "tessera-coordinator").spec.clusterIP, "would set TESSERA_COORDINATOR_PORT"],
  ["a worker count off the coordinator's", (r) => (envVar(r, "coordinator", "TESSERA_COORDINATOR_EXPECTED_DEVICES").value = "7"), "expects 7 devices"],
  ["an optional credentials Secret", (r) => (workload(r, "worker").spec.template.spec.volumes.find((v) => v.name === "secret").secret.optional = true), "must be required"],
  // The audit's case: every worker held every device's key and the admin token.
  ["a worker mounting the whole Secret", (r) => container(r, "worker").volumeMounts.push({ name: "secret", mountPath: "/etc/tessera/secret", readOnly: true }), "container worker mounts the Secret tessera-credentials"],
  ["a coordinator mounting the whole Secret", (r) => (container(r, "coordinator").volumeMounts.find((m) => m.name === "credentials").name = "secret"), "container coordinator mounts the Secret"],
  ["credentials on the node's disk", (r) => delete workload(r, "worker").spec.template.spec.volumes.find((v) => v.name === "credentials").emptyDir.medium, "in-memory emptyDir"],
  ["a worker given the coordinator's files", (r) => (workload(r, "worker").spec.template.spec.initContainers[0].command[2] = "--role=coordinator"), "--role=worker"],
  ["a worker's files for another device id", (r) => (workload(r, "worker").spec.template.spec.initContainers[0].command[3] = "--device_id=0"), "--device_id_from="],
  ["no init container", (r) => delete workload(r, "coordinator").spec.template.spec.initContainers, "select-credentials"],
  ["compose without credentials", (r, c) => delete c.services["worker-5"].environment.TESSERA_WORKER_CREDENTIALS, "docker-compose.yml: worker-5"],
  // The audit's case: 768 MiB of buffers and the default 256 MiB cache filled a 1 GiB limit.
  ["a buffer cache the memory limit does not hold", (r) => (envVar(r, "worker", "TESSERA_WORKER_BUFFER_CACHE_BYTES").value = "268435457"), "for the process itself"],
  ["compose without room for the process", (r, c) => (c.services["worker-3"].mem_limit = "1g"), "docker-compose.yml: worker-3: --memory_bytes"],
  // Stopped before the drain ends: the runs in flight fail instead of finishing.
  ["a grace period shorter than the drain", (r) => (workload(r, "worker").spec.template.spec.terminationGracePeriodSeconds = 8), "grace period 8 s is shorter than the drain"],
  ["a drain the grace period does not cover", (r) => (envVar(r, "worker", "TESSERA_WORKER_DRAIN_TIMEOUT_MS").value = "7000"), "--drain_timeout_ms 7000"],
  ["slower heartbeats the grace period does not cover", (r) => container(r, "coordinator").env.push({ name: "TESSERA_COORDINATOR_HEARTBEAT_INTERVAL_MS", value: "2000" }), "a heartbeat in flight and the deregistration 12000"],
  ["a coordinator stopped before its calls end", (r) => (workload(r, "coordinator").spec.template.spec.terminationGracePeriodSeconds = 2), "grace period 2 s is shorter than its shutdown"],
  ["compose stopping a worker before its drain ends", (r, c) => (c.services["worker-6"].stop_grace_period = "5s"), "docker-compose.yml: worker-6: grace period 5 s"],
  // Misspelt: accepted by the schemas' validators and dropped by a server; the rule for the
  // field itself sees the real one (the first) or none (the second).
  ["a misspelt field", (r) => (workload(r, "worker").spec.template.spec.terminationGracePeriodSecond = 10), "unknown field spec.template.spec.terminationGracePeriodSecond"],
  ["a misspelt field in a list", (r) => (container(r, "coordinator").securityContext.readOnlyRootFilesytem = true), "unknown field spec.template.spec.containers[0].securityContext.readOnlyRootFilesytem"],
  ["a misspelt Service field", (r) => (service(r, "tessera-workers").spec.publishNotReadyAdresses = true), "unknown field spec.publishNotReadyAdresses"],
  ["a misspelt top-level field", (r) => (service(r, "tessera").metdata = { name: "x" }), "unknown field metdata"],
  ["a Kubernetes worker waiting for shared memory no other pod shares", (r) => (envVar(r, "worker", "TESSERA_WORKER_SHM").value = "true"), 'TESSERA_WORKER_SHM is "true", deploy/daemons.json says "false"'],
  ["compose with a writable root", (r, c) => delete c.services["worker-4"].read_only, "docker-compose.yml: worker-4: read_only"],
  ["compose drifting", (r, c) => (c.services["worker-2"].environment.TESSERA_WORKER_MEMORY_BYTES = "1"), "docker-compose.yml: worker-2"],
  // An evicted Indexed-Job worker must be replaced, not counted done: a worker exiting 0 after
  // its drain (the binary, not the manifest: its --help overridden), a policy ending the index.
  ["a worker exiting 0 after a drain, in a Job", () => {}, "exits 0 after a drain on SIGTERM", { drainExitStatus: 0 }],
  ["a Job of pods restarted always", (r) => (job(r).spec.template.spec.restartPolicy = "Always"), "restartPolicy Always"],
  ["a pod failure policy failing the Job on an eviction", (r) => {
    job(r).spec.template.spec.restartPolicy = "Never";
    job(r).spec.podFailurePolicy = { rules: [{ action: "FailJob", onPodConditions: [{ type: "DisruptionTarget" }] }] };
  }, "podFailurePolicy rule 0 (FailJob) matches a worker stopped by SIGTERM (DisruptionTarget)"],
  ["a pod failure policy failing the index on the drain's status", (r) => {
    job(r).spec.template.spec.restartPolicy = "Never";
    job(r).spec.backoffLimitPerIndex = 1;
    job(r).spec.podFailurePolicy = { rules: [{ action: "FailIndex", onExitCodes: { operator: "NotIn", values: [1] } }] };
  }, "podFailurePolicy rule 0 (FailIndex) matches a worker stopped by SIGTERM (exit status"],
  ["a Job replacing a pod while it drains", (r) => delete job(r).spec.podReplacementPolicy, "podReplacementPolicy TerminatingOrFailed (the default)"],
  ["a pod failure policy with restartPolicy OnFailure", (r) => (job(r).spec.podFailurePolicy = { rules: [{ action: "Ignore", onPodConditions: [{ type: "DisruptionTarget" }] }] }), "a podFailurePolicy needs restartPolicy Never, not OnFailure"],
];
const first = (r) => Object.values(r)[0];
const workload = (r, role_) => first(r).find((o) => WORKLOADS.has(o.kind) && role(o) === role_);
const container = (r, role_) => workload(r, role_).spec.template.spec.containers[0];
const envVar = (r, role_, name) => container(r, role_).env.find((e) => e.name === name);
const service = (r, name) => first(r).find((o) => o.kind === "Service" && o.metadata.name === name);
const job = (r) => Object.values(r).flat().find((o) => o.kind === "Job");

async function check() {
  const [binDir] = rest;
  const rendered = Object.fromEntries(overlays().map((o) => [o, render(path.join(overlaysDir(), o))]));
  const composeText = fs.readFileSync(path.join(sourceDir, "deploy/docker-compose.yml"), "utf8");
  const compose = () => YAML.parse(composeText, { merge: true });
  const failures = await failuresOf(rendered, compose(), binDir);
  // deploy/README.md's in-cluster client (```yaml blocks opening with "# NAME.yaml"), as a
  // user would `kubectl apply -f` it.
  const readme = fs.readFileSync(path.join(sourceDir, "deploy/README.md"), "utf8");
  let examples = 0;
  for (const [, name, text] of readme.matchAll(/^```yaml\n# ([\w.-]+\.yaml)[^\n]*\n([\s\S]*?)^```$/gm)) {
    for (const o of YAML.parseAllDocuments(text).map((d) => d.toJS())) {
      ++examples;
      for (const f of await schemaFailures(o)) failures.push(`deploy/README.md: ${name}: ${o.kind} ${o.metadata?.name}: ${f}`);
    }
  }
  if (examples === 0) failures.push("deploy/README.md: no ```yaml block opening with '# NAME.yaml' (the in-cluster client)");
  for (const f of failures) console.log(`FAIL ${f}`);
  const objects = Object.values(rendered).reduce((n, docs) => n + docs.length, 0);
  console.log(`${Object.keys(rendered).length} overlays (${Object.keys(rendered).join(", ")}), ${objects} objects, ` +
              `${examples} in deploy/README.md: ${failures.length} failures`);
  // The rules themselves: each mutation of the real manifests must fail them.
  let missed = 0;
  for (const [what, mutate, expected, binaries] of MUTATIONS) {
    const r = structuredClone(rendered), c = compose();
    mutate(r, c);
    const found = (await failuresOf(r, c, binDir, binaries)).filter((f) => f.includes(expected));
    if (found.length === 0) {
      ++missed;
      console.log(`FAIL the rules miss ${what} (no failure saying '${expected}')`);
    }
  }
  console.log(`${MUTATIONS.length - missed} of ${MUTATIONS.length} broken variants caught`);
  process.exit(failures.length === 0 && missed === 0 ? 0 : 1);
}

// The pods of one overlay as the controllers would name them, and their containers' command
// lines and environment as the kubelet would start them.
function pods() {
  const [overlay, namespace] = rest;
  const docs = render(overlay);
  const out = { pods: [], dns: {} };
  const made = [];
  for (const o of docs.filter((x) => WORKLOADS.has(x.kind))) {
    const t = o.spec.template;
    const instances = [];
    if (o.kind === "Deployment") {
      for (let i = 0; i < (o.spec.replicas ?? 1); ++i) {
        const name = `${o.metadata.name}-6b7f9c8d5-${"abcde".slice(i)}${i}`;
        instances.push({ name, hostname: t.spec.hostname ?? name, labels: {}, annotations: {} });
      }
    } else if (o.kind === "StatefulSet") {
      for (let i = 0; i < o.spec.replicas; ++i) {
        const name = `${o.metadata.name}-${i}`;
        instances.push({ name, hostname: name, subdomain: o.spec.serviceName, labels: {}, annotations: {} });
      }
    } else {
      if (o.spec.completionMode !== "Indexed") throw new Error(`${o.metadata.name}: only Indexed Jobs`);
      for (let i = 0; i < o.spec.completions; ++i) {
        const index = String(i);
        instances.push({
          name: `${o.metadata.name}-${i}-x7k2q`,
          hostname: `${o.metadata.name}-${i}`,
          subdomain: t.spec.subdomain,
          labels: { "batch.kubernetes.io/job-name": o.metadata.name, "job-name": o.metadata.name,
                    "batch.kubernetes.io/job-completion-index": index },
          annotations: { "batch.kubernetes.io/job-completion-index": index },
          jobIndex: index,
        });
      }
    }
    for (const p of instances) {
      const meta = { name: p.name, namespace, labels: { ...t.metadata.labels, ...p.labels },
                     annotations: { ...(t.metadata.annotations ?? {}), ...p.annotations } };
      const field = (fieldPath) => {
        const m = /^metadata\.(labels|annotations)\['([^']+)'\]$/.exec(fieldPath);
        if (m) return meta[m[1]][m[2]] ?? "";
        if (fieldPath === "metadata.name") return meta.name;
        if (fieldPath === "metadata.namespace") return meta.namespace;
        throw new Error(`${p.name}: fieldRef ${fieldPath} is not emulated`);
      };
      // A container as the kubelet starts it: its command line, environment, and volume mounts
      // (each with the volume's kind: "secret" for the Secret, "emptyDir" for one of the pod's own).
      const started = (c) => {
        const vars = {};
        const env = [];
        const envList = [...(c.env ?? [])];
        // The Job controller appends JOB_COMPLETION_INDEX unless the container declares it.
        if (p.jobIndex !== undefined && !envList.some((e) => e.name === "JOB_COMPLETION_INDEX")) {
          envList.push({ name: "JOB_COMPLETION_INDEX", value: p.jobIndex });
        }
        for (const e of envList) {
          let value;
          if (e.valueFrom?.fieldRef) value = field(e.valueFrom.fieldRef.fieldPath);
          else if (e.valueFrom) throw new Error(`${p.name}: ${e.name}: only fieldRef is emulated`);
          else value = expand(e.value ?? "", vars);
          vars[e.name] = value;
          env.push([e.name, value]);
        }
        // What the runtime adds: the pod's host name (the image's PATH is the test's to give).
        env.push(["HOSTNAME", p.hostname]);
        const argv = [...(c.command ?? []), ...(c.args ?? [])].map((a) => expand(a, vars));
        const mounts = (c.volumeMounts ?? []).map((m) => {
          const v = (t.spec.volumes ?? []).find((x) => x.name === m.name);
          const kind = v?.secret ? "secret" : v?.emptyDir ? "emptyDir" : null;
          if (!kind) throw new Error(`${p.name}: volume ${m.name}: only secret and emptyDir are emulated`);
          return { path: m.mountPath, volume: m.name, kind, read_only: m.readOnly === true };
        });
        return { argv, env, mounts };
      };
      out.pods.push({ name: p.name, role: meta.labels["app.kubernetes.io/component"], hostname: p.hostname,
                      ...started(t.spec.containers[0]), init: (t.spec.initContainers ?? []).map(started),
                      grace_seconds: t.spec.terminationGracePeriodSeconds ?? 30,
                      restart_policy: t.spec.restartPolicy ?? "Always",
                      // What Prometheus' common pod-annotation rules scrape (0: not scraped).
                      scrape_port: meta.annotations["prometheus.io/scrape"] === "true"
                        ? Number(meta.annotations["prometheus.io/port"] ?? 0) : 0,
                      scrape_path: meta.annotations["prometheus.io/path"] ?? "/metrics" });
      made.push({ ...p, labels: meta.labels });
    }
  }
  // The cluster DNS (CoreDNS's records for Services): NAME.NS.svc.DOMAIN for every Service
  // (headless: its pods; with a cluster IP: the Service, which here means its pods), and
  // HOSTNAME.SUBDOMAIN.NS.svc.DOMAIN for a pod of a headless Service named by its subdomain.
  for (const s of docs.filter((x) => x.kind === "Service")) {
    const selected = made.filter((p) => Object.entries(s.spec.selector ?? {}).every(([k, v]) => p.labels[k] === v));
    out.dns[`${s.metadata.name}.${namespace}.svc.${CLUSTER_DOMAIN}`] = selected.map((p) => p.name);
    if (s.spec.clusterIP !== "None") continue;
    for (const p of selected.filter((x) => x.subdomain === s.metadata.name)) {
      out.dns[`${p.hostname}.${s.metadata.name}.${namespace}.svc.${CLUSTER_DOMAIN}`] = [p.name];
    }
  }
  console.log(JSON.stringify(out, null, 1));
}

if (command === "check") await check();
else if (command === "pods") pods();
else {
  console.error("usage: k8s.mjs check SOURCE_DIR BIN_DIR | pods SOURCE_DIR OVERLAY NAMESPACE");
  process.exit(2);
}
