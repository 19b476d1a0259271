// The faults tests/test_receipt_snippets.py stages around the node app (node --require), when
// the app ends its answer (after its COMMIT), as the request's X-Fault header asks: "late" ends
// it after 4 s (past the proxy's upstream.timeout), "kill" SIGKILLs the process first. The
// app's own code is the page's, untouched.
const http = require("node:http");

const end = http.ServerResponse.prototype.end;
http.ServerResponse.prototype.end = function (...args) {
  const fault = this.req.headers["x-fault"];
  if (fault === "kill") process.kill(process.pid, "SIGKILL");
  if (fault === "late") {
    setTimeout(() => end.apply(this, args), 4000);
    return this;
  }
  return end.apply(this, args);
};
