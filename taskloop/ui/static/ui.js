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
