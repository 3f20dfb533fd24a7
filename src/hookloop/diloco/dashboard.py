"""The page ``GET /dashboard`` serves: the server's status, refreshed every two seconds,
with buttons for the admin routes. It reads ``/status`` and posts to ``/control/...``
with the bearer token typed into the page (kept in the tab's sessionStorage)."""

from __future__ import annotations

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>DiLoCo Dashboard</title>
<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}
.err{color:#b00}</style></head><body>
<h1>DiLoCo server</h1>
<p>Token (only if the server has one): <input id="tok" type="password" size="40"></p>
<div id="summary">loading...</div><h2>Workers</h2>
<table><thead><tr><th>id</th><th>host</th><th>syncs</th><th>steps/s</th>
<th>last heartbeat</th><th></th></tr></thead><tbody id="workers"></tbody></table>
<h2>Admin</h2>
<p>outer lr <input id="lr" size="6"> momentum <input id="mom" size="6">
<button onclick="act('update_optimizer',{lr:+lr.value,momentum:+mom.value})">apply</button>
&nbsp; workers <input id="nw" size="4">
<button onclick="act('update_num_workers',{num_workers:+nw.value})">apply</button>
&nbsp; <button onclick="act('save_state',{})">save now</button>
<button onclick="confirm('Shut the server down?')&&act('shutdown',{})">shut down</button></p>
<p id="msg"></p>
<script>
const tok=document.getElementById('tok');tok.value=sessionStorage.getItem('tok')||'';
tok.onchange=()=>sessionStorage.setItem('tok',tok.value);
function hdrs(){const h={'Content-Type':'application/json'};
 if(tok.value)h['Authorization']='Bearer '+tok.value;return h}
function text(s){const d=document.createElement('span');d.textContent=String(s);return d.innerHTML}
async function act(a,body){const r=await fetch('/control/'+a,{method:'POST',headers:hdrs(),
 body:JSON.stringify(body)});const m=document.getElementById('msg');
 m.className=r.ok?'':'err';m.textContent=a+': '+await r.text();refresh()}
async function refresh(){try{const r=await fetch('/status',{headers:hdrs()});const s=await r.json();
 if(!r.ok){summary.innerHTML='<span class=err>'+text(s.error)+'</span>';return}
 summary.innerHTML='mode '+text(s.mode)+' &middot; round '+text(s.sync_round)+' &middot; workers '
  +text(s.num_registered)+'/'+text(s.num_workers)+' &middot; outer lr '+text(s.outer_lr)
  +' momentum '+text(s.outer_momentum)+' &middot; '+text(s.model_params)+' parameters ('
  +text(s.model_size_mb)+' MB) &middot; up '+text(Math.round(s.uptime_seconds))+' s';
 let rows='';for(const [id,w] of Object.entries(s.workers)){rows+='<tr><td>'+text(id)+'</td><td>'
  +text(w.hostname)+'</td><td>'+text(w.sync_round)+'</td><td>'+text(w.steps_per_second.toFixed(2))
  +'</td><td>'+text(new Date(w.last_heartbeat*1000).toLocaleTimeString())
  +'</td><td><button data-id="'+text(id)+'" onclick="act(\\'kick_worker\\',{worker_id:'
  +'this.dataset.id})">kick</button></td></tr>'}
 workers.innerHTML=rows}catch(e){summary.textContent='server unreachable'}}
refresh();setInterval(refresh,2000);
</script></body></html>
"""
