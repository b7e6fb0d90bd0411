"""The built-in /dashboard page: the block pool drawn live, one cell per block."""

DASHBOARD_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>pyllama-paged: KV block pool</title>
<!-- an empty icon: without it the browser asks for /favicon.ico, a 404 (401 with a key) in its console -->
<link rel="icon" href="data:,">
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; background: #fafafa; }
 #grid { display: flex; flex-wrap: wrap; gap: 2px; max-width: 1100px; }
 .b { width: 12px; height: 12px; border-radius: 2px; }
 .free { background: #e0e0e0; } .used { background: #2e7d32; }
 .shared { background: #1565c0; } .cached { background: #f9a825; }
 .legend span { display: inline-block; margin-right: 1em; }
 .legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: middle; }
 #summary { white-space: pre; }  /* keeps the spaces between the figures */
 pre { background: #fff; padding: .6em; border: 1px solid #ddd; }
</style></head><body>
<h2>KV block pool <small id="model"></small></h2>
<div class="legend"><span><i class="free"></i>free</span><span><i class="used"></i>used</span>
<span><i class="shared"></i>shared</span><span><i class="cached"></i>cached (evictable)</span></div>
<p id="summary"></p><div id="grid"></div><pre id="stats"></pre>
<script>
// The key comes from the page's address (?key= or #key=) and goes in a header: in a query
// it would be written to the server's access log with every poll.
const key = new URLSearchParams(location.hash.slice(1)).get("key") || new URLSearchParams(location.search).get("key");
if (key) history.replaceState(null, "", location.pathname);
const headers = key ? {"X-API-Key": key} : {};
async function refresh() {
  try {
    const r = await fetch("/api/pool", {headers});
    const d = await r.json();
    // an error answer ({"error": ...}) has no blocks: say what the server said
    if (!r.ok) throw new Error("HTTP " + r.status + ": " + (d.error || r.statusText));
    document.getElementById("model").textContent = d.model + (d.paged ? " (paged, " + d.block_size + " tokens/block)" : " (slabs)") + (d.loaded === false ? ", not loaded (keep_alive let it go)" : "");
    const grid = document.getElementById("grid");
    if (grid.children.length !== d.blocks.length) {
      grid.innerHTML = "";
      for (let i = 0; i < d.blocks.length; i++) { const c = document.createElement("div"); grid.appendChild(c); }
    }
    d.blocks.forEach((s, i) => { grid.children[i].className = "b " + s; });
    document.getElementById("summary").textContent = Object.entries(d.counts || {}).map(([k, v]) => k + ": " + v).join("   ") + (d.current === false ? "   (engine busy: last known figures)" : "");
    document.getElementById("stats").textContent = JSON.stringify(d.stats, null, 1);
  } catch (e) { document.getElementById("summary").textContent = "error: " + e.message; }
  // the next poll after this one has answered: a busy engine answers slowly, and polls on a
  // fixed interval would pile up behind it
  setTimeout(refresh, 500);
}
refresh();
</script></body></html>
"""
