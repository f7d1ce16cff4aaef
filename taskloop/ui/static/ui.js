// taskloop run UI: what htmx does not do for us. A live update swaps the run's whole body; this
// keeps what a person had opened (a long output, a traceback) open across the swap.
(function () {
  "use strict";
  var opened = [];
  document.addEventListener("htmx:sseBeforeMessage", function (event) {
    opened = Array.prototype.map.call(event.target.querySelectorAll("details[open][id]"), function (d) { return d.id; });
  });
  document.addEventListener("htmx:sseMessage", function () {
    opened.forEach(function (id) {
      var found = document.getElementById(id);
      if (found) { found.open = true; }
    });
  });
})();

// A run's live text (what its phases stream with ctx.stream): read from /api/runs/<id>/stream as
// server-sent events and written under each round, as text nodes only (streamed text is model
// output: it never becomes HTML). The chunks are kept here, so a live update that swaps the body
// shows them again; the stream closes once the run has ended (event "end").
(function () {
  "use strict";
  var section = document.querySelector("[data-live-text]");
  if (!section || !window.EventSource) { return; }
  var texts = {};  // "task|round" -> [{phase, segment, items: [{note: bool, text}]}]

  function add(chunk) {
    var key = chunk.task + "|" + chunk.round;
    var parts = texts[key] || (texts[key] = []);
    var part = parts[parts.length - 1];
    if (!part || part.phase !== chunk.phase || part.segment !== chunk.segment) {
      part = {phase: chunk.phase, segment: chunk.segment, items: []};
      parts.push(part);
    }
    if (chunk.dropped) {
      part.items.push({note: true, text: "[… " + chunk.dropped + " bytes dropped here: the store did not take them …]"});
    }
    if (chunk.text) {
      var last = part.items[part.items.length - 1];
      if (last && !last.note) { last.text += chunk.text; } else { part.items.push({note: false, text: chunk.text}); }
    }
    if (chunk.capped) {
      part.items.push({note: true, text: "[… the phase reached its cap: the rest is in its recorded output …]"});
    }
    return key;
  }

  function span(className, text) {
    var found = document.createElement("span");
    found.className = className;
    found.textContent = text;
    return found;
  }

  function render(key) {
    var parts = texts[key];
    document.querySelectorAll("pre[data-stream]").forEach(function (pre) {
      if (pre.getAttribute("data-stream") !== key) { return; }
      var follow = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      pre.textContent = "";
      parts.forEach(function (part) {
        var label = part.phase + (part.segment > 1 ? " · executed again (segment " + part.segment + "): its text starts over" : "");
        pre.appendChild(span("stream-phase" + (part.segment > 1 ? " replay" : ""), label));
        part.items.forEach(function (item) {
          pre.appendChild(item.note ? span("stream-note", item.text) : document.createTextNode(item.text));
        });
      });
      var row = pre.closest("tr.stream-row");
      if (row) { row.classList.add("has-text"); }
      if (follow) { pre.scrollTop = pre.scrollHeight; }
    });
  }

  var source = new EventSource(section.getAttribute("data-live-text"));
  source.addEventListener("chunk", function (event) { render(add(JSON.parse(event.data))); });
  source.addEventListener("end", function () { source.close(); });
  document.addEventListener("htmx:sseMessage", function () { Object.keys(texts).forEach(render); });
})();

// An action that asks first (a form with data-confirm: cancelling a run), and, after an action
// was refused, the address of the run page in place of the form's (/runs/<id>/resume): a reload
// shows the run, it does not post the form again.
(function () {
  "use strict";
  document.addEventListener("submit", function (event) {
    var question = event.target.getAttribute && event.target.getAttribute("data-confirm");
    if (question && !window.confirm(question)) { event.preventDefault(); }
  });
  var refused = document.querySelector("[data-run-url]");
  if (refused && window.history && location.pathname !== refused.getAttribute("data-run-url")) {
    window.history.replaceState(null, "", refused.getAttribute("data-run-url"));
  }
})();
