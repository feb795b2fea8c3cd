// Validates custom resources against the schemas of @kubernetes-models (generated from the
// upstream CRDs). Reads a JSON array of objects on stdin; writes a JSON array of
// {kind, name, error} (error null when valid). Exit 0 unless the input cannot be read.
import { readFileSync } from "node:fs";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";

const MODELS = {
  "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor,
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
};

const objects = JSON.parse(readFileSync(0, "utf8"));
const results = objects.map((object) => {
  const key = `${object.apiVersion}/${object.kind}`;
  const Model = MODELS[key];
  let error = null;
  if (!Model) {
    error = `no published schema here for ${key}`;
  } else {
    try {
      new Model(object).validate();
    } catch (exc) {
      error = String(exc.message || exc);
    }
  }
  return { kind: object.kind, name: object.metadata?.name ?? null, error };
});
process.stdout.write(JSON.stringify(results));
